"""The from-scratch control (`finetune.control=scratch`): what pretraining bought, on the registry version.

The same sweep - grid, seeds, epochs, examples, trial code - run a second time from the same architecture's initial
weights (no pretraining), its best grid point chosen as the stage chooses the champion (seed mean of the dev metric).
The champion's registry version then carries `scratch_<metric>` (that seed mean) and `gain_over_scratch` (the
champion's seed mean minus it), with `scratch_trial_config`; the control's trials are in results_scratch.csv and
nested MLflow runs of their own. It doubles the stage's sweep.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from stages.base import StageContext
    from stages.finetune.data import Encoded
    from stages.finetune.trial import TrialSetup


def scratch_backbone(setup: "TrialSetup", seed: int = 0) -> dict[str, "torch.Tensor"]:
    """The backbone as a fresh model has it: the model library's initialisation, seeded."""
    import torch

    from deberta import checkpoint
    from deberta.model import init_weights

    torch.manual_seed(seed)
    head = setup.kind.build_head(setup.model, setup.num_labels, 0.0)
    head.apply(lambda m: init_weights(m, setup.model))
    return {k: v for k, v in head.state_dict().items() if k.startswith(checkpoint.BACKBONE_PREFIX)}


def run_control(setup: "TrialSetup", data: tuple["Encoded", "Encoded"], ctx: "StageContext", metric: str,
                champion: dict[str, Any], out: Path) -> dict[str, Any]:
    """Sweep from scratch; {"tags": for the registry version, "metrics": for the stage's run}."""
    from stages.finetune.registry import _jsonable
    from stages.finetune.sweep import GRID_KEYS, _trial_runs_callback, pick_champion, results_table, run_sweep

    name = f"{ctx.run_name}-scratch"
    print(f"[finetune] control: the same grid and seeds from the initial weights ({name})", flush=True)
    grid = run_sweep(setup.ft, setup, data, scratch_backbone(setup), ctx.storage_path, name,
                     callbacks=[_trial_runs_callback(ctx.tracker, metric, name)])
    table = results_table(grid, metric)
    table.drop(columns=["trial_path"]).to_csv(out / "results_scratch.csv", index=False)
    best = pick_champion(table, metric)
    gain = float(champion["seed_mean"]) - float(best["seed_mean"])
    print(f"[finetune] control: from scratch {metric} {best['seed_mean']:.4f} (seed mean), pretrained "
          f"{champion['seed_mean']:.4f}: gain {gain:+.4f}", flush=True)
    config = {k: _jsonable(best)[k] for k in GRID_KEYS}
    return {"tags": {f"scratch_{metric}": f"{best['seed_mean']:.6f}", "gain_over_scratch": f"{gain:.6f}",
                     "scratch_trial_config": json.dumps(config, sort_keys=True)},
            "metrics": {f"scratch_{metric}_seed_mean": float(best["seed_mean"]), "gain_over_scratch": gain}}
