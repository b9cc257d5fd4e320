"""Config resolution and validation: every user mistake gets one message naming the key and the fix."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError, apply_overrides, check_cluster, validate
from pipeline.presets import GRID_1_5B, GRID_BASE, GRID_LARGE, PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate(name):
    cfg = PRESETS[name]()
    validate(cfg)
    assert cfg.preset == name
    # Table 8: 2,048 sequences per step for the paper's sizes
    if name.startswith("deberta-") and "-v3-" not in name:
        p = cfg.pretrain
        assert p.train_batch_size == 2048 and p.max_steps == 1_000_000 and p.warmup_steps == 10_000
        assert (p.weight_decay, p.adam_eps, p.adam_beta1, p.adam_beta2, p.grad_clip) == (0.01, 1e-6, 0.9, 0.999, 1.0)


def test_table8_learning_rates_and_vocab():
    assert PRESETS["deberta-1.5b"]().pretrain.lr == 1.5e-4
    assert PRESETS["deberta-large"]().pretrain.lr == 2e-4
    assert PRESETS["deberta-base"]().pretrain.lr == 2e-4
    big = PRESETS["deberta-1.5b"]()
    assert big.vocab.vocab_size == 128_000 and big.model.vocab_size == 128_100
    assert big.pretrain.zero_stage == 3 and big.finetune.sift


def test_table9_grids_exact():
    cfg = PRESETS["deberta-1.5b"]().finetune
    assert (cfg.dropout, cfg.warmup_steps, cfg.lr, cfg.batch_size) == (
        (0, 0.15, 0.3), (50, 100, 500, 1000), (1e-6, 3e-6, 5e-6), (16, 32, 64))
    assert GRID_LARGE["lr"] == (5e-6, 8e-6, 9e-6, 1e-5) and GRID_LARGE["batch_size"] == (16, 32, 48, 64)
    assert GRID_BASE["lr"] == (1.5e-5, 2e-5, 3e-5, 4e-5) and GRID_BASE["dropout"] == (0, 0.1, 0.15)
    assert GRID_1_5B["dropout"] == (0, 0.15, 0.3)
    assert cfg.seeds == (0, 1, 2, 3, 4)  # A.10: the mean over 5 seeds


def test_override_types():
    cfg = apply_overrides(PRESETS["debug"](), [
        "pretrain.max_steps=7", "pretrain.lr=1e-3", "pretrain.use_gpu=false",
        "finetune.lr=1e-5,2e-5", "finetune.max_train_examples=none", "model.num_hidden_layers=3"])
    assert cfg.pretrain.max_steps == 7 and cfg.pretrain.lr == 1e-3 and cfg.pretrain.use_gpu is False
    assert cfg.finetune.lr == (1e-5, 2e-5) and cfg.finetune.max_train_examples is None
    assert cfg.model.num_hidden_layers == 3


@pytest.mark.parametrize("item, fragment", [
    ("nosection.key=1", "unknown section 'nosection'"),
    ("pretrain.nokey=1", "unknown key 'nokey' in [pretrain]"),
    ("pretrain.max_steps=abc", "expected int"),
    ("pretrain.use_gpu=maybe", "expected true or false"),
    ("max_steps=3", "expected section.key=value"),
])
def test_override_errors_name_the_key(item, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        apply_overrides(PRESETS["debug"](), [item])


def test_batch_divisibility_checked():
    cfg = apply_overrides(PRESETS["debug"](), ["pretrain.train_batch_size=20"])
    with pytest.raises(ConfigError, match="must equal micro_batch_size x accumulation x workers"):
        validate(cfg)


def test_zero_stage_and_gpu_checked():
    with pytest.raises(ConfigError, match="ZeRO stages are 0, 1, 2 and 3"):
        validate(apply_overrides(PRESETS["debug"](), ["pretrain.zero_stage=4"]))
    gpu = apply_overrides(PRESETS["debug"](), ["pretrain.use_gpu=true"])
    with pytest.raises(ConfigError, match="asks for 2 GPUs but the Ray cluster has 0"):
        check_cluster(gpu, ["pretrain"], cpus=8, gpus=0)
    check_cluster(gpu, ["corpus"], cpus=8, gpus=0)  # only the stages about to run are checked
    with pytest.raises(ConfigError, match="set ray.num_cpus=4"):
        check_cluster(PRESETS["debug"](), ["pretrain"], cpus=2, gpus=0)


def test_embedding_rows_cover_tokenizer():
    cfg = PRESETS["debug"]()
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=cfg.vocab.vocab_size))
    with pytest.raises(ConfigError, match="embedding rows < tokenizer length"):
        validate(small)


def test_finetune_trial_layout_of_the_presets():
    assert PRESETS["deberta-base"]().finetune.trainer == "torch"
    large, big = PRESETS["deberta-large"]().finetune, PRESETS["deberta-1.5b"]().finetune
    assert (large.trainer, large.workers_per_trial) == ("deepspeed", 2)
    assert (big.trainer, big.workers_per_trial, big.use_gpu) == ("deepspeed", 8, True)
    check_cluster(PRESETS["deberta-1.5b"](), ["finetune"], cpus=64, gpus=8)


@pytest.mark.parametrize("items, fragment", [
    (["finetune.trainer=horovod"], "finetune.trainer='horovod': use torch or deepspeed"),
    (["finetune.workers_per_trial=2"], "workers_per_trial=2 needs finetune.trainer=deepspeed"),
    (["finetune.trainer=deepspeed", "finetune.workers_per_trial=3", "finetune.batch_size=16,24"],
     r"batch_size \[16\] cannot be split evenly over workers_per_trial=3"),
    (["finetune.trainer=deepspeed", "finetune.zero_stage=5"], "finetune.zero_stage=5: DeepSpeed ZeRO stages"),
    (["finetune.trainer=deepspeed", "finetune.scheduler=asha"], "asha cannot stop DeepSpeed trials.*scheduler=grid"),
    (["finetune.trainer=deepspeed", "finetune.workers_per_trial=0"], "must be >= 1"),
])
def test_finetune_trainer_errors_name_the_key_and_fix(items, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate(apply_overrides(PRESETS["debug"](), items))


def test_finetune_init_is_a_how_field_and_pretrained_its_short_form():
    """The checkpoint's own digest is the finetune stage's input, so where it lies (or which URI named it) must not
    change the artifact id; `--pretrained X` sets the same field."""
    from pipeline.run import build_parser, resolve_config

    base = PRESETS["debug"]().finetune
    moved = apply_overrides(PRESETS["debug"](), ["finetune.init=models:/deberta-debug-pretrained@champion"]).finetune
    assert base.init == "" and moved.init == "models:/deberta-debug-pretrained@champion"
    assert "init" not in base.what() and moved.what() == base.what()
    args = build_parser().parse_args(["--pretrained", "/ckpt/deberta-v3-small"])
    assert resolve_config(args).finetune.init == "/ckpt/deberta-v3-small"


def test_finetune_gpus_per_trial_checked_against_the_cluster():
    with pytest.raises(ConfigError, match="needs 8 GPU\\(s\\) per trial but the Ray cluster has 4"):
        check_cluster(PRESETS["deberta-1.5b"](), ["finetune"], cpus=64, gpus=4)


@pytest.mark.parametrize("item, fragment", [
    ("tokenize.max_seq_len=2", "tokenize.max_seq_len=2: needs room for"),
    ("tokenize.max_seq_len=256", "tokenize.max_seq_len=256 exceeds model.max_position_embeddings=128"),
    ("finetune.max_seq_len=256", "finetune.max_seq_len=256 exceeds model.max_position_embeddings=128"),
    ("tokenize.num_workers=0", "tokenize.num_workers=0: use at least 1"),
    ("vocab.sample_documents=0", "vocab.sample_documents=0: must be >= 1"),
    ("vocab.num_threads=-1", "vocab.num_threads=-1: must be >= 0"),
    ("pretrain.placement_strategy=RANDOM", "placement_strategy='RANDOM': use one of PACK"),
    ("pretrain.log_interval=0", "pretrain.log_interval=0: must be >= 1"),
    ("pretrain.max_steps=0", "pretrain.max_steps=0: must be >= 1"),
    ("model.num_attention_heads=3", "model.hidden_size=64 is not a multiple of model.num_attention_heads=3"),
    ("model.attn_impl=flash", "model.attn_impl='flash'"),
    ("finetune.max_train_examples=0", "finetune.max_train_examples=0"),
])
def test_every_stage_enforced_bound_is_checked_up_front(item, fragment):
    """What a stage used to refuse only after the stages before it had run is refused by `validate`."""
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate(apply_overrides(PRESETS["debug"](), [item]))


@pytest.mark.parametrize("items, fragment", [
    (["pretrain.probes=wnut16-ner", "pretrain.probe_interval=300"],
     "pretrain.probe_interval=300 must be a multiple of pretrain.ckpt_interval=200"),
    (["pretrain.probes=wnut16-ner,wnut16-ner"], "pretrain.probes=wnut16-ner,wnut16-ner: a task is named twice"),
    (["pretrain.probes=wnut16-ner", "pretrain.probe_seeds="], "pretrain.probe_seeds is empty"),
    (["pretrain.probes=wnut16-ner", "pretrain.probe_examples=0"], "pretrain.probe_examples=0: must be >= 1"),
    (["pretrain.probes=wnut16-ner", "pretrain.probe_max_seq_len=256"],
     "pretrain.probe_max_seq_len=256 exceeds model.max_position_embeddings=128"),
    (["pretrain.probes=wnut16-ner", "pretrain.probe_gpus=0.5"], "pretrain.probe_gpus=0.5: a share of one GPU"),
    (["finetune.control=pretrained"], "finetune.control='pretrained': use scratch"),
])
def test_probe_and_control_settings_are_checked_up_front(items, fragment):
    """Refused by `validate`, before Ray starts."""
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate(apply_overrides(PRESETS["debug"](), items))


def test_probes_are_how_fields():
    """Probing a run measures it without changing its weights: the same pretrain artifact id with or without."""
    cfg = PRESETS["debug"]()
    probed = apply_overrides(cfg, ["pretrain.probes=wnut16-ner", "pretrain.probe_seeds=0,1"])
    assert probed.pretrain.what() == cfg.pretrain.what() and probed.pretrain.probe_seeds == (0, 1)
    assert "control" in cfg.finetune.what()  # the control adds to what the finetune stage registers
    validate(apply_overrides(cfg, ["pretrain.probe_interval=300"]))  # probes off: their settings are not in the way


def test_model_section_is_the_model_library_config():
    """[model] is `DebertaConfig` itself: its own checks come back as one ConfigError naming `model.<field>`, fields
    that only fit together change together, and `attn_impl` (a *how* field) stays out of artifact ids."""
    from deberta.config import DebertaConfig

    cfg = PRESETS["debug"]()
    assert type(cfg.model) is DebertaConfig and "attn_impl" not in cfg.model.what()
    with pytest.raises(ConfigError, match=r"^model.hidden_size=65 is not a multiple of model.num_attention_heads=2; "):
        apply_overrides(cfg, ["model.hidden_size=65"])
    with pytest.raises(ConfigError, match=r"^model.share_layers='layers'; choose one of"):
        apply_overrides(cfg, ["model.share_layers=layers"])
    wider = apply_overrides(cfg, ["model.num_attention_heads=3", "model.hidden_size=96", "model.attn_impl=math"])
    assert (wider.model.hidden_size, wider.model.num_attention_heads, wider.model.attn_impl) == (96, 3, "math")
    assert apply_overrides(cfg, ["model.attn_impl=math"]).model.what() == cfg.model.what()


def test_config_and_presets_import_no_torch():
    """The command line resolves and checks a config before any framework loads."""
    code = "import sys, core.config, pipeline.presets; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_what_and_how_fields():
    p = PRESETS["debug"]().pretrain
    assert "log_interval" not in p.what() and "cpus_per_worker" not in p.what() and "lr" in p.what()
    for section in ("corpus", "vocab", "tokenize", "pretrain", "finetune", "model", "ray"):
        s = getattr(PRESETS["debug"](), section)
        assert set(s.HOW) <= set(s.to_dict()), section  # every *how* name is a real field


@pytest.mark.parametrize("name, shape, lr", [
    ("deberta-v3-xsmall", (12, 384, 6, 1536), 6e-4), ("deberta-v3-small", (6, 768, 12, 3072), 6e-4),
    ("deberta-v3-base", (12, 768, 12, 3072), 6e-4), ("deberta-v3-large", (24, 1024, 16, 4096), 3e-4),
])
def test_v3_presets_are_table10(name, shape, lr):
    cfg = PRESETS[name]()
    m, p = cfg.model, cfg.pretrain
    assert (m.num_hidden_layers, m.hidden_size, m.num_attention_heads, m.intermediate_size) == shape
    assert (m.position_buckets, m.share_att_key, m.norm_rel_ebd, m.conv_kernel_size, m.vocab_size) == (
        256, True, True, 0, 128_100)
    assert (p.objective, p.rtd_weight, p.embedding_sharing, p.generator_layers) == ("rtd", 50.0, "gdes", None)
    assert (p.lr, p.train_batch_size, p.max_steps, p.warmup_steps) == (lr, 8192, 500_000, 10_000)
    assert (p.adam_eps, p.adam_beta1, p.adam_beta2, p.weight_decay, p.grad_clip) == (1e-6, 0.9, 0.98, 0.01, 1.0)
    assert cfg.finetune.dropout == ((0.0, 0.15, 0.3) if name.endswith("large") else (0.0, 0.1, 0.15))


@pytest.mark.parametrize("items, fragment", [
    (["pretrain.objective=electra"], "pretrain.objective='electra': use mlm or rtd"),
    (["pretrain.objective=rtd", "pretrain.embedding_sharing=tied"],
     "pretrain.embedding_sharing='tied': use gdes, es or nes"),
    (["pretrain.objective=rtd", "pretrain.rtd_weight=0"], "pretrain.rtd_weight=0.0: must be > 0"),
    (["pretrain.objective=rtd", "pretrain.generator_layers=0"], "pretrain.generator_layers=0: must be >= 1"),
    (["pretrain.objective=rtd", "pretrain.generator_init=/released/gen"], "only read when continuing pretraining"),
    (["pretrain.generator_init=/released/gen"], "the mlm objective has no generator"),
])
def test_objective_config_errors(items, fragment):
    """Each objective checks the fields it reads (`stages.pretrain.objectives.check_config`), beside `validate`,
    which leaves them alone; the command line runs both."""
    from pipeline.run import UserError, build_parser, resolve_config
    from stages.pretrain import check_config

    cfg = apply_overrides(PRESETS["debug"](), items)
    validate(cfg)
    with pytest.raises(ConfigError, match=fragment):
        check_config(cfg.pretrain, cfg.model)
    with pytest.raises(UserError, match=fragment):
        resolve_config(build_parser().parse_args([arg for item in items for arg in ("--set", item)]))


def test_an_objective_reads_only_its_own_fields():
    """RTD's settings are RTD's: the MLM objective neither reads nor checks them."""
    from stages.pretrain import check_config

    cfg = apply_overrides(PRESETS["debug"](), ["pretrain.rtd_weight=0", "pretrain.embedding_sharing=tied"])
    check_config(cfg.pretrain, cfg.model)
