"""The objective owns its step's words: the loop and the registry name no objective and no objective's metric or
column (they ask the `Objective`), and ALBERT's SOP is one composition onto either objective."""

import pickle
import re
from pathlib import Path

import pytest
import torch

from core.config import PretrainConfig
from stages.pretrain.objectives import OBJECTIVES, objective_for

ROOT = Path(__file__).resolve().parents[2]
SHARED = ("stages/pretrain/loop.py", "stages/pretrain/registry.py", "stages/pretrain/probes.py")
"""The files every objective goes through."""
GENERIC = {"loss", "val_loss", "input_ids"}
"""What every objective has: the loop's own words."""


def _variants() -> list:
    """Every objective alone and with SOP, with every option that adds a column."""
    return [objective_for(PretrainConfig(objective=name, sop=sop, document_mask=name == "mlm" and not sop))
            for name in OBJECTIVES for sop in (False, True)]


def _objective_words() -> set[str]:
    """Names of the objectives and of everything they read and log, collected from the objectives themselves."""
    words = {*OBJECTIVES, "sop"}
    for o in _variants():
        words |= {*o.step_metrics, *o.progress_metrics, *o.final_metrics, *o.model_inputs, *o.model_inputs.values()}
        words |= set(o.finish_step_metrics({k: 1.0 for k in ("loss", *o.step_metrics)}))
    return words - GENERIC


def test_loop_and_registry_name_no_objective_and_no_objective_metric():
    """The issue's own check, `git grep` of the shared files, with the words taken from the objectives."""
    words = _objective_words()
    assert {"mlm", "rtd", "sop", "rtd_accuracy", "sop_accuracy", "val_accuracy", "sop_labels", "doc_index"} <= words
    for path in SHARED:
        text = (ROOT / path).read_text()
        found = sorted({w for w in words if re.search(rf"(?<![a-z0-9]){re.escape(w)}(?![a-z0-9])", text, re.I)})
        assert not found, f"{path} names {found}: ask the objective (stages/pretrain/objective.py) instead"


def test_sop_is_one_composition_onto_either_objective():
    """SOP adds its column, head, loss term, metrics and words in sop.py; the objectives themselves never read
    `pretrain.sop`. The composed objective survives a pickle (Ray ships it to the workers)."""
    from deberta.config import debug
    from stages.pretrain.sop import SentenceOrder

    for name in ("mlm", "rtd"):
        assert not re.search(r"(?<![a-z])sop(?![a-z])", (ROOT / f"stages/pretrain/{name}.py").read_text(), re.I)
        plain, sop = objective_for(PretrainConfig(objective=name)), objective_for(PretrainConfig(objective=name, sop=True))
        assert isinstance(sop, SentenceOrder) and isinstance(sop, OBJECTIVES[name]) and not isinstance(plain, SentenceOrder)
        assert (sop.name, sop.title, sop.model_options()) == (name, f"{name} + sop", {"sop": True})
        assert sop.shard_columns == (*plain.shard_columns, "sop_label")
        assert sop.loss_label == plain.loss_label.replace(" loss", " + SOP loss")
        factory, _ = sop.build_model(debug(vocab_size=300))
        heads = [n for n, _ in factory().named_modules() if n.endswith("sop_head")]
        assert len(heads) == 1
        again = pickle.loads(pickle.dumps(sop))
        assert type(again) is type(sop) and again.cfg == sop.cfg
    assert objective_for(PretrainConfig(objective="rtd", rtd_weight=50.0)).loss_label == "generator MLM + 50 x RTD loss"
    rtd_sop = objective_for(PretrainConfig(objective="rtd", sop=True))
    means = {"mlm_loss": 1.0, "rtd_loss": 0.5, "rtd_accuracy": 0.9, "sop_accuracy": 0.6, "replaced_fraction": 0.1}
    assert rtd_sop.step_line(means) == " mlm_loss 1.0000 rtd_loss 0.5000 rtd_accuracy 0.9000 sop_accuracy 0.6000"


class Steps(OBJECTIVES["mlm"]):
    """An objective the loop has never heard of: the MLM, showing how many targets a row has."""

    step_metrics = ("num_targets",)
    progress_metrics = ("targets_per_row",)

    def finish_step_metrics(self, means: dict[str, float]) -> dict[str, float]:
        targets = means.pop("num_targets")
        return {**means, "targets_per_row": targets / self.cfg.micro_batch_size}


def test_a_new_objectives_numbers_reach_the_progress_line_and_mlflow(capsys):
    """The loop's own step and log (`train_step`, `log_step`) on a plain torch engine, one gloo rank: the toy
    objective's metric is printed and logged although the loop does not know its name."""
    import torch.distributed as dist

    from deberta.config import debug
    from stages.pretrain.checkpoints import TrainState
    from stages.pretrain.loop import LoopJob, Throughput, log_step, optim_spec, train_step
    from stages.pretrain.rank_zero import RankZero
    from training.deepspeed_config import build_deepspeed_config
    from training.engine import build

    cfg = PretrainConfig(num_workers=1, micro_batch_size=4, train_batch_size=4, max_steps=1, warmup_steps=1)
    objective, model = Steps(cfg), debug(vocab_size=300)
    job = LoopJob(cfg=cfg, objective=objective, model=model, ds_config=build_deepspeed_config(cfg, 1, False),
                  seq_len=16, train_files=(), val_files=(), tokenizer_len=300, mask_id=299, special_ids=(0, 1, 2, 3),
                  word_start=b"", train_flops_per_token=1.0, tracker=None)
    factory, _ = objective.build_model(model)
    engine = build(factory, optim_spec(cfg), seed=0)
    ids = torch.randint(5, 299, (4, 16), generator=torch.Generator().manual_seed(0)).numpy()
    masker = objective.masker(300, 299, (0, 1, 2, 3), None)
    rank0 = RankZero(0, tracker=None)
    rank0.close(0)  # prints only: no tracking server in a unit test
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        means = train_step(engine, objective, masker, [objective.batch({"input_ids": ids})], step=0)
        logged = log_step(job, rank0, engine, means, TrainState(step=1), 1, Throughput(job, 1, 0))
    finally:
        dist.destroy_process_group()
    line = capsys.readouterr().out
    assert "targets_per_row" in logged and "num_targets" not in logged
    assert f" targets_per_row {logged['targets_per_row']:.4f} lr " in line, line
    assert logged["targets_per_row"] == pytest.approx(means["num_targets"] / 4) and logged["targets_per_row"] > 0


def test_every_objectives_probe_backbone_is_what_a_task_head_loads():
    """Probes fine-tune from `Objective.backbone_weights` without naming an objective: for each (with SOP too) the
    weights cover exactly a task head's `deberta.*` parameters (RTD: the discriminator's, not the generator's)."""
    from deberta.config import debug
    from deberta.heads import DebertaForSequenceClassification
    from stages.pretrain.probes import initial_backbone

    model = debug(vocab_size=300)
    head = DebertaForSequenceClassification(model, 2, 0.0).state_dict()
    wanted = {k: v.shape for k, v in head.items() if k.startswith("deberta.")}
    for objective in _variants():
        weights = initial_backbone(objective, model, seed=0)
        assert {k: v.shape for k, v in weights.items()} == wanted, objective.title
