"""paramfsm with other libraries: :mod:`paramfsm.integrations.hf` (Hugging Face transformers),
:mod:`paramfsm.integrations.accelerate` (an Accelerator for Accelerate scripts) and
:mod:`paramfsm.integrations.peft` (saving PEFT adapters).

Each integration imports its library when it is imported itself, never from ``import paramfsm``.
"""
