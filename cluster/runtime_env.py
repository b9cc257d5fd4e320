"""The runtime env for `ray job submit`: what of this repository travels to the cluster, and which settings.

`ray job submit --working-dir .` zips the directory and uploads it through the job server (limit
~500 MB). A working copy holds far more than the code: the virtualenv, pipeline outputs under
`workdir/`, git history, checkpoints. Ray already skips what `.gitignore` lists; the excludes here
make that independent of the ignore file and of where the user keeps outputs.

    ray job submit --working-dir . --runtime-env-json "$(python -m cluster.runtime_env)" \\
        -- python -m pipeline.run --preset debug

prints `{"excludes": [...], "env_vars": {"MLFLOW_TRACKING_URI": ...}}`; `--working-dir` supplies
the directory. The MLflow URI is forwarded only when set (the job then logs to that server,
typically the one on the head node, http://127.0.0.1:5000).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# gitignore-style patterns, relative to the working dir (Ray's `excludes` syntax).
EXCLUDES = (
    ".venv/", "venv/", ".git/", "workdir/", "__pycache__/", "*.egg-info/", ".pytest_cache/", "build/",
    "ray_results/", "mlruns/", "mlartifacts/",
    "*.pt", "*.bin", "*.safetensors", "*.ckpt", "*.parquet", "*.arrow", "*.zip", "*.tar*",
)

# Settings of the submitting shell that the job must see, when set. Object-store keys are not among them: a runtime
# env is shown by the dashboard and `ray job list`; the nodes hold their own (an instance profile, the AWS_* of
# the raylets' environment), and only where the store is travels with the job.
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION",
                 "AWS_PROFILE")


def runtime_env(working_dir: str | None = None, env: dict[str, str] | None = None,
                extra_env: dict[str, str] | None = None) -> dict:
    """A Ray runtime_env dict for the pipeline's job. `working_dir` None: `--working-dir` gives it."""
    env = os.environ if env is None else env
    env_vars = {k: env[k] for k in FORWARDED_ENV if env.get(k)}
    env_vars.update(extra_env or {})
    out: dict = {"excludes": list(EXCLUDES)}
    if working_dir is not None:
        out["working_dir"] = working_dir
    if env_vars:
        out["env_vars"] = env_vars
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.runtime_env",
                                description="Print the pipeline job's runtime env as JSON for "
                                            "`ray job submit --runtime-env-json`.")
    p.add_argument("--working-dir", help="include working_dir (default: left to `ray job submit --working-dir`)")
    p.add_argument("--env", metavar="KEY=VALUE", action="append", default=[],
                   help="extra environment variable for the job (repeatable)")
    args = p.parse_args(argv)
    extra = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"error: --env {item!r} is not KEY=VALUE", file=sys.stderr)
            return 2
        extra[key] = value
    print(json.dumps(runtime_env(args.working_dir, extra_env=extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
