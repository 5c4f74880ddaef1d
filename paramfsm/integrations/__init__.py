"""paramfsm with other libraries: :mod:`paramfsm.integrations.hf` (Hugging Face transformers) and
:mod:`paramfsm.integrations.peft` (saving PEFT adapters).

Each integration imports its library when it is imported itself, never from ``import paramfsm``.
"""
