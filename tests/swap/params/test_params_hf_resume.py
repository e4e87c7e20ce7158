"""Resuming a streamed Trainer run from an in-memory run's checkpoint as users do it: the Trainer's own optimizer
(which does not name its parameters), a scheduler with warm-up, and a streamed run resumed, saved and resumed
again (see docs/guides/hugging-face.md)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from deepoffload import TrainOptions, trainer_arguments  # noqa: E402
from deepoffload.errors import CheckpointError  # noqa: E402
from deepoffload.swap.params import offload_parameters  # noqa: E402
from tests.swap.params.test_params_hf import pair, states_equal  # noqa: E402


def data():
    generator = torch.Generator().manual_seed(3)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (12, 12), generator=generator)]


def trainer(model, folder, **extra):
    args = transformers.TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=2,
        max_steps=6,
        max_grad_norm=0,
        learning_rate=1e-2,
        warmup_steps=3,
        weight_decay=0.1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return transformers.Trainer(model, args, train_dataset=data(), **extra)


def name_the_parameters(checkpoint, model, memory: transformers.Trainer) -> None:
    """The refusal's advice for a checkpoint whose optimizer did not name its parameters: name them in optimizer.pt
    (group i's names, in the order the in-memory Trainer grouped them)."""
    path = checkpoint / "optimizer.pt"
    saved = torch.load(path, weights_only=True)
    decay = set(memory.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]]
    assert [len(g["params"]) for g in saved["param_groups"]] == [len(g) for g in groups]
    for group, names in zip(saved["param_groups"], groups):
        group["param_names"] = names
    torch.save(saved, path)


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_the_trainers_own_optimizer_resumes_streamed_by_following_the_refusal(scratch, tmp_path, mode):
    """Trainer's default AdamW (decay and no-decay groups) and a linear schedule with warm-up, in memory for 6 steps
    saving every 2; a streamed run resumed from its checkpoint-2 is refused, naming what to do; once the checkpoint
    names its parameters (the advice) and the streamed optimizer groups them as the Trainer did, the resumed streamed
    run (warm-up not over at step 2) ends with the in-memory run's weights and saves checkpoint-4, and another
    streamed run resumed from that ends with them too."""
    memory_model, model, again = pair("llama")[0], *pair("llama")
    memory = trainer(memory_model, tmp_path / "memory")
    memory.train()
    decay = set(memory.get_decay_parameter_names(memory_model))
    assert decay and decay != {n for n, _ in memory_model.named_parameters()}  # two groups, both used

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    def grouped(model):
        """The second refusal's advice: a factory that groups the parameters as the Trainer did."""
        decayed = {id(p) for n, p in model.named_parameters() if n in decay}

        def factory(params):
            groups = [[p for p in params if id(p) in decayed], [p for p in params if id(p) not in decayed]]
            return torch.optim.AdamW(
                [{"params": g, "weight_decay": w} for g, w in zip(groups, (0.1, 0.0)) if g], lr=1e-2
            )

        return factory

    with offload_parameters(model, str(scratch / "a"), train=TrainOptions(mode=mode, optimizer=adamw)) as offload:
        streamed = trainer(model, tmp_path / "a", **trainer_arguments(offload))
        with pytest.raises(CheckpointError, match=r"param_names"):
            streamed.train(resume_from_checkpoint=str(tmp_path / "memory" / "checkpoint-2"))
    name_the_parameters(tmp_path / "memory" / "checkpoint-2", memory_model, memory)
    with offload_parameters(model, str(scratch / "a2"), train=TrainOptions(mode=mode, optimizer=adamw)) as offload:
        streamed = trainer(model, tmp_path / "a", **trainer_arguments(offload))
        with pytest.raises(CheckpointError, match=r"make the optimizer factory of offload_parameters\(\) group them"):
            streamed.train(resume_from_checkpoint=str(tmp_path / "memory" / "checkpoint-2"))
    with offload_parameters(
        model, str(scratch / "a3"), train=TrainOptions(mode=mode, optimizer=grouped(model))
    ) as offload:
        streamed = trainer(model, tmp_path / "a", **trainer_arguments(offload))
        streamed.train(resume_from_checkpoint=str(tmp_path / "memory" / "checkpoint-2"))
        assert streamed.state.global_step == 6
        assert states_equal(model.state_dict(), memory_model.state_dict())
    with offload_parameters(
        again, str(scratch / "b"), train=TrainOptions(mode=mode, optimizer=grouped(again))
    ) as offload:
        streamed = trainer(again, tmp_path / "b", **trainer_arguments(offload))
        streamed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
        assert streamed.state.global_step == 6
        assert states_equal(again.state_dict(), memory_model.state_dict())
