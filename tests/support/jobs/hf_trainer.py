"""A job on the Hugging Face Transformers `Trainer` (Accelerate underneath), as its users write
it: a small GPT-2 trained from scratch on CPU with gloo under torchrun, nothing of snapshotter.

usage: hf_trainer.py --out OUT [--steps N] [--step-sleep S]
Prints "rank R step N loss L" per optimizer step; rank 0 writes the sha256 of the final
parameters to OUT.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PrintSteps(TrainerCallback):
    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            rank = int(os.environ.get("RANK", "0"))
            print(f"rank {rank} step {state.global_step} loss {logs['loss']:.6f}", flush=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        time.sleep(self.sleep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(
            output_dir=out_dir,
            max_steps=a.steps,
            per_device_train_batch_size=4,
            learning_rate=3e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            ddp_backend="gloo",
            seed=0,
            data_seed=7,
            dataloader_num_workers=1,
            # One fork of the worker for the whole run, not one per epoch: a fork of a process
            # whose gloo threads hold a lock can deadlock in the child (seen here once in a
            # plain torchrun run), and each fork is a chance of it.
            dataloader_persistent_workers=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Tokens(512, 32, cfg.vocab_size),
            callbacks=[PrintSteps(a.step_sleep)],
        )
        trainer.train()
    h = hashlib.sha256()
    for p in trainer.model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    if trainer.args.process_index == 0:
        with open(a.out, "w") as f:
            json.dump({"digest": h.hexdigest()}, f)


if __name__ == "__main__":
    main()
