"""A Lightning DDP job on CPU: Lightning starts the second process itself (no launcher).

The two profd lines are at the top, before Lightning has set any rank. Env: STEPS (default
8), GATE (a file every rank waits for at the start of training, after the process group
exists, so a test can arm explicit steps first). Prints ``RESULT {json}`` per rank.
"""

import profd_client

profd_client.attach()

import json  # noqa: E402
import os  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from gate import wait_gate  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: list[torch.Tensor], _idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Gate(L.Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        wait_gate()


def main() -> None:
    steps = int(os.environ.get("STEPS", "8"))
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64 * steps, 32), torch.randn(64 * steps, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Gate()],
    )
    trainer.fit(Model(), DataLoader(data, batch_size=32))
    ident = profd_client.identity()
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": trainer.global_rank,
                "profd_rank": ident.rank if ident else None,
                "steps": profd_client.current_step(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
