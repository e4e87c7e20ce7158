"""Fine-tune a Hugging Face model with ``transformers.Trainer`` while its blocks stream from storage
(``offload_parameters`` + ``trainer_arguments``), save Trainer checkpoints, and resume from one. The resumed run
ends with the same weights as the uninterrupted one, and both equal the same Trainer run in memory.

    python examples/trainer_streaming.py [--folder /nvme] [--steps 6] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

import deepoffload
from deepoffload import trainer_arguments


def make_model(layers: int, hidden: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def dataset(count: int = 32, length: int = 16) -> list[dict]:
    ids = torch.randint(0, 128, (count, length), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def streamed_trainer_class():
    import transformers

    # --8<-- [start:resume]
    class StreamedTrainer(transformers.Trainer):
        """A Trainer that leaves loading a checkpoint's weights to offload_parameters(load=LoadOptions(checkpoint=))."""

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            pass

    # --8<-- [end:resume]
    return StreamedTrainer


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def run(
    output_dir: str, swap_folder: str | None, steps: int, layers: int, hidden: int, resume: str | None = None
) -> list[torch.Tensor]:
    """Train with the Trainer (streamed when ``swap_folder`` is given) and return the final parameters."""
    import transformers

    model = make_model(layers, hidden)
    StreamedTrainer = streamed_trainer_class()
    # --8<-- [start:trainer]
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=steps // 2,
        max_grad_norm=0,  # streamed blocks: the Trainer cannot clip them (see the guide)
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if swap_folder is None:
        trainer = transformers.Trainer(
            model, args, train_dataset=dataset(), optimizers=(adamw(model.parameters()), None)
        )
        trainer.train(resume_from_checkpoint=resume)
        return [p.detach().clone() for p in model.parameters()]
    # resuming: the weights are loaded block by block by offload_parameters(load=LoadOptions(checkpoint=...)), since
    # streamed parameters refuse load_state_dict; the Trainer then loads the optimizer, scheduler and RNG states
    with deepoffload.offload_parameters(
        model,
        swap_folder,
        train=deepoffload.TrainOptions(optimizer=adamw),
        load=deepoffload.LoadOptions(checkpoint=resume),
    ) as off:
        trainer = StreamedTrainer(model, args, train_dataset=dataset(), **trainer_arguments(off))
        trainer.train(resume_from_checkpoint=resume)
    # --8<-- [end:trainer]
    return [p.detach().clone() for p in model.parameters()]  # closing read the trained weights back


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", default=None, help="where the blocks go (your NVMe); default: a temp folder")
    parser.add_argument("--steps", type=int, default=6, help="even: a checkpoint is saved half way")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="a few seconds: 2 layers of width 32, 2 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.steps = 2, 32, 2
    with tempfile.TemporaryDirectory() as scratch:
        swap = args.folder or scratch
        memory = run(f"{scratch}/memory", None, args.steps, args.layers, args.hidden)
        streamed = run(f"{scratch}/streamed", swap, args.steps, args.layers, args.hidden)
        half = f"{scratch}/streamed/checkpoint-{args.steps // 2}"
        resumed = run(f"{scratch}/resumed", swap, args.steps, args.layers, args.hidden, resume=half)
    same = all(torch.equal(a, b) for a, b in zip(streamed, memory))
    same_resumed = all(torch.equal(a, b) for a, b in zip(resumed, streamed))
    print(f"streamed Trainer identical to the Trainer in memory: {'yes' if same else 'NO'}")
    print(
        f"resumed from {half.rsplit('/', 1)[-1]}, identical to the uninterrupted run: {'yes' if same_resumed else 'NO'}"
    )
    return 0 if same and same_resumed else 1


if __name__ == "__main__":
    sys.exit(main())
