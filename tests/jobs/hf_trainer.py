"""A Hugging Face ``Trainer`` job on CPU under torchrun (gloo), the two profd lines at the top.

The model is a tiny GPT-2 built from a config and the data are made in memory, so nothing is
downloaded (run with ``HF_HUB_OFFLINE=1``). Gradient accumulation is 2: each optimizer step
is two forward/backward passes, and profd's step is the optimizer step. Env: STEPS (the
Trainer's ``max_steps``, default 8), GATE (a file every rank waits for in ``on_train_begin``,
after the process group exists, so a test can arm explicit steps first), OUT (the Trainer's
output dir; nothing is saved there). Prints ``RESULT {json}`` per rank.
"""

import profd_client

profd_client.attach()

import json  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from gate import wait_gate  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

SEQ = 16


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, their own labels (causal LM)."""

    def __init__(self, n: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Gate(TrainerCallback):
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        wait_gate()


def main() -> None:
    steps = int(os.environ.get("STEPS", "8"))
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=SEQ,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,  # GPT-2's own (50256) is outside this vocabulary
        eos_token_id=0,
    )
    args = TrainingArguments(
        output_dir=os.environ.get("OUT", "hf-out"),
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        report_to=[],
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(64, config.vocab_size),
        callbacks=[Gate()],
    )
    trainer.train()
    ident = profd_client.identity()
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": args.process_index,
                "world_size": args.world_size,
                "profd_rank": ident.rank if ident else None,
                "global_step": trainer.state.global_step,
                "steps": profd_client.current_step(),
            }
        ),
        flush=True,
    )
    # Trainer leaves the process group up (and its DDP model holds it): end it as PyTorch's
    # docs ask every training script to, after dropping the trainer (see ending.py).
    from ending import end_process_group

    del trainer
    end_process_group()


if __name__ == "__main__":
    main()
