"""Deployments in code, mirroring ``prefect.yaml`` (same names, entrypoints, parameters, schedules).

``python -m deployments.register`` registers them with the Prefect API in PREFECT_API_URL and serves
them from this process (``prefect.serve``), so runs started from the UI or the API execute here.
``prefect deploy --all`` with ``prefect.yaml`` targets the ``local`` process work pool instead.
"""

from __future__ import annotations

from typing import Any

from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Schedule

from flows.canary import canary, canary_recover
from flows.curate import curate, recover
from flows.evaluation import harbor_export, harbor_import, judge
from flows.lifecycle import lifecycle
from flows.promote import promote
from flows.registry import (
    migrate_images,
    prewarm_plan,
    registry_audit,
    rewrite_image_refs,
)
from flows.rescore import rescore
from flows.stages import DEMO_FREEZE_QUOTAS, base_model, compare, freeze, package, publish, serve
from flows.training import ppo, rl_burst, sft_burst, windows

WORK_POOL = "local"

SPECS: list[dict[str, Any]] = [
    {"flow": lifecycle, "entrypoint": "flows/lifecycle.py:lifecycle", "name": "lifecycle",
     "parameters": {}, "cron": "0 2 * * *"},
    {"flow": migrate_images, "entrypoint": "flows/registry.py:migrate_images", "name": "migrate",
     "parameters": {}},
    {"flow": registry_audit, "entrypoint": "flows/registry.py:registry_audit", "name": "registry-audit",
     "parameters": {}, "cron": "0 3 * * 1"},
    {"flow": prewarm_plan, "entrypoint": "flows/registry.py:prewarm_plan", "name": "prewarm-plan",
     "parameters": {}},
    {"flow": rewrite_image_refs, "entrypoint": "flows/registry.py:rewrite_image_refs", "name": "rewrite-image-refs",
     "parameters": {}},
    {"flow": freeze, "entrypoint": "flows/stages.py:freeze", "name": "freeze",
     "parameters": {"params": {"name": "demo-v1", "quotas": DEMO_FREEZE_QUOTAS.model_dump(), "seed": 0}}},
    {"flow": canary, "entrypoint": "flows/canary.py:canary", "name": "canary",
     "parameters": {"params": {"freeze_name": "demo-v1", "split": "test",
                               "run": {"concurrency": 1, "profile": "default"}}}},
    {"flow": canary_recover, "entrypoint": "flows/canary.py:canary_recover", "name": "canary-recover",
     "parameters": {}},
    {"flow": rescore, "entrypoint": "flows/rescore.py:rescore", "name": "rescore",
     "parameters": {}},
    {"flow": compare, "entrypoint": "flows/stages.py:compare", "name": "compare",
     "parameters": {}},
    {"flow": curate, "entrypoint": "flows/curate.py:curate", "name": "curate",
     "parameters": {"params": {"settings": {"batch_size": 40, "concurrency": 10, "max_retries": 2,
                                            "verifier_timeout_s": 180.0, "seed": 0}}}},
    {"flow": recover, "entrypoint": "flows/curate.py:recover", "name": "recover",
     "parameters": {}},
    {"flow": base_model, "entrypoint": "flows/stages.py:base_model", "name": "base-model", "parameters": {}},
    {"flow": package, "entrypoint": "flows/stages.py:package", "name": "package", "parameters": {}},
    {"flow": publish, "entrypoint": "flows/stages.py:publish", "name": "publish", "parameters": {}},
    {"flow": promote, "entrypoint": "flows/promote.py:promote", "name": "promote", "parameters": {}},
    {"flow": serve, "entrypoint": "flows/stages.py:serve", "name": "serve", "parameters": {}},
    {"flow": harbor_export, "entrypoint": "flows/evaluation.py:harbor_export", "name": "harbor-export",
     "parameters": {}},
    {"flow": harbor_import, "entrypoint": "flows/evaluation.py:harbor_import", "name": "harbor-import",
     "parameters": {}},
    {"flow": judge, "entrypoint": "flows/evaluation.py:judge", "name": "judge", "parameters": {}},
    {"flow": sft_burst, "entrypoint": "flows/training.py:sft_burst", "name": "sft-burst", "parameters": {}},
    {"flow": rl_burst, "entrypoint": "flows/training.py:rl_burst", "name": "rl-burst", "parameters": {}},
    {"flow": ppo, "entrypoint": "flows/training.py:ppo", "name": "ppo", "parameters": {}},
    {"flow": windows, "entrypoint": "flows/training.py:windows", "name": "windows", "parameters": {}},
]
"""One entry per deployment of prefect.yaml; schedules (nightly lifecycle, weekly registry audit)
are created paused. A parameter a flow requires and that has no working default here (a job id, a
GGUF path, a prefix) is left out: Prefect asks for it at run time.

A stage flow takes one parameter model, ``params`` (flows.stagekit.StageParams); its working defaults
are the model's field defaults, not deployment-level nested values: Prefect merges a run's parameters
over the deployment's shallowly, so a run that gives ``params`` replaces the deployment's whole
object. The ``freeze`` deployment still gives its (default) ``params`` in full, so every freeze run's
recorded parameters carry ``params.name``, which the canary-on-freeze automation renders. The ``canary``
deployment shows its working defaults (freeze ``demo-v1``, split ``test``, one trial at a time on the
``default`` profile) as its ``params``; they are the model's defaults too, so a run that gives its own
``params`` (the canary-on-freeze automation gives only ``freeze_name``) keeps them; so does ``curate``'s
(its validation settings). ``rescore`` needs ``params.job_id`` and ``recover`` ``params.reason``, so they
give none (``recover``: a dry run by default); nor do the training flows (``sft-burst``, ``rl-burst``, ``ppo``,
``windows``), whose ``params`` need the run's
inputs (``hf_dir``, ``samples_jsonl``/``tasks_jsonl``, verl's ``settings`` and the Ray ``job``, a job id or
folder): their hyper-parameters' defaults are ``params.training``'s.
The registry flows' working defaults (the demo's loopback registries ``127.0.0.1:5701`` / ``:5702``, transfer
limits, the 80-shard layout, a dry-run rewrite) are their models' (:class:`flows.registry.MigrateParams`, ...),
so their deployments give none; ``registry-audit`` and ``migrate`` need ``params.images`` or
``params.dataset_path``, ``rewrite-image-refs`` needs ``params.old_prefix`` and ``params.new_prefix``."""


def build_deployments(work_pool_name: str | None = None) -> list[RunnerDeployment]:
    """The deployments as Prefect objects (nightly lifecycle schedule paused).

    Args:
        work_pool_name: None for ``prefect.serve``; ``"local"`` to target the process pool.
    """
    out = []
    for spec in SPECS:
        schedules = [Schedule(cron=spec["cron"], timezone="UTC", active=False)] if "cron" in spec else None
        out.append(spec["flow"].to_deployment(name=spec["name"], parameters=spec["parameters"],
                                              work_pool_name=work_pool_name, schedules=schedules))
    return out


def main() -> None:
    """Register every deployment with the Prefect API and serve them until interrupted."""
    from prefect import serve

    serve(*build_deployments())


if __name__ == "__main__":
    main()
