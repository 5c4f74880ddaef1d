"""Train a Hugging Face causal LM with ``transformers.Trainer`` on a model sharded by paramfsm.

    torchrun --nproc-per-node 2 examples/hf_trainer.py
    torchrun --nproc-per-node 2 examples/hf_trainer.py --model path/to/model --out /tmp/hf-trainer

It writes its checkpoints and final model under ``--out`` (default
``runs/hf-trainer``, a folder the checkout's ``.gitignore`` covers) and names
the folder when it ends.

Without ``--model`` it builds a tiny random-init GPT-2, so it runs anywhere
(CPU ranks over gloo, GPUs over NCCL, one GPU per rank) with no download. The
data are random tokens: the point is the recipe, every step of which runs on
every rank:

1. ``init_process_group``, put the model on this rank's device, ``rt = paramfsm.shard(model)``;
2. ``ShardedTrainer(model=model, args=args, train_dataset=..., runtime=rt).train()``;
3. ``trainer.save_model(d)`` writes, from rank 0, what a plain ``save_pretrained`` writes;
4. ``from_pretrained(d)`` loads it back (here: checked against the sharded model's logits);
5. ``rt.generate(...)`` with a different prompt per rank.

Needs ``pip install "transformers[torch]"`` (the Trainer needs accelerate).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers

import paramfsm
from paramfsm.integrations.hf import ShardedTrainer


def build_model(name: str | None):
    if name:
        return transformers.AutoModelForCausalLM.from_pretrained(name)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def random_tokens(vocab: int, samples: int, seq: int):
    tokens = torch.randint(1, vocab, (samples, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in tokens]


#: Where the checkpoints and the final model go by default (under ``runs/``, which ``.gitignore`` covers).
DEFAULT_OUT = os.path.join("runs", "hf-trainer")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local directory or hub name (default: a tiny random GPT-2)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"output directory for checkpoints and the final model (default: {DEFAULT_OUT})")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch size")
    parser.add_argument("--seq", type=int, default=32)
    return parser.parse_args(argv)


def main() -> None:
    opts = parse_args()

    dist.init_process_group()  # torchrun's environment; NCCL for CUDA tensors, gloo for CPU ones
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    model = build_model(opts.model).to(device)
    rt = paramfsm.shard(model)  # param_dtype=torch.bfloat16 gathers in bf16; args.bf16 (autocast) works too
    args = transformers.TrainingArguments(
        output_dir=opts.out, per_device_train_batch_size=opts.batch, max_steps=opts.steps, learning_rate=1e-3,
        weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, save_strategy="steps", save_steps=opts.steps,
        report_to="none", use_cpu=device.type == "cpu", disable_tqdm=True)
    data = random_tokens(model.config.vocab_size, opts.steps * opts.batch * dist.get_world_size(), opts.seq)
    trainer = ShardedTrainer(model=model, args=args, train_dataset=data, runtime=rt)
    trainer.train()  # resume later with trainer.train(resume_from_checkpoint=True)

    final = os.path.join(opts.out, "final")
    trainer.save_model(final)  # collective: every rank gathers, rank 0 writes
    dist.barrier()

    prompt = torch.randint(1, model.config.vocab_size, (1, 4 + rank), device=device,
                           generator=torch.Generator(device).manual_seed(rank))
    model.eval()  # the Trainer leaves it in train mode (dropout)
    with torch.no_grad():
        sharded_logits = model(prompt).logits
        loaded = type(model).from_pretrained(final).to(device)
        error = (loaded(prompt).logits - sharded_logits).abs().max().item()
        tokens = rt.generate(prompt, max_new_tokens=4 + 2 * rank, do_sample=False)  # different lengths per rank
    print(f"rank {rank}: reloaded model's max logit difference {error:.2e}; generated {tokens.tolist()}")
    if rank == 0:
        print(f"checkpoints and the final model are in {os.path.abspath(opts.out)}")
    rt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
