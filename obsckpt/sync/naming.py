"""Finding the job's synchronizer: the namespace it is named in, and the root it watches."""

from __future__ import annotations

import os
from typing import Any

from obsckpt.options import SYNCHRONIZER_ACTOR_NAME as ACTOR_NAME


def namespace_of(namespace: Any, config: Any) -> str | None:
    """The namespace ``get_actor`` was given, or Trinity's ``config.ray_namespace``.

    Trinity passes its config first (``get_actor(config)``) or as ``config=``.
    """
    if namespace is not None and not isinstance(namespace, str):
        config, namespace = namespace, None  # Trinity: get_actor(config)
    if isinstance(namespace, str):
        return namespace
    found = getattr(config, "ray_namespace", None) if config is not None else None
    if found is None or isinstance(found, str):
        return found
    raise TypeError(
        f"config.ray_namespace must be a str, got {type(found).__name__} "
        f"{found!r}; pass namespace= explicitly"
    )


def check_root(actor: Any, default_local_dir: str, namespace: str | None) -> None:
    """Refuse a synchronizer that watches another root than ``default_local_dir`` (or none).

    get_if_exists hands back a synchronizer already running under the name,
    whatever root it watches: the rollout would then never see this job's steps.
    """
    import ray

    running: str | None = ray.get(actor.checkpoint_root.remote())
    same = running is not None and (
        running == default_local_dir
        or os.path.realpath(running) == os.path.realpath(default_local_dir)
    )
    if not same:
        where = f"namespace {namespace!r}" if namespace else "this job's namespace"
        watched = f"watches {running!r}" if running else "watches no checkpoint root"
        raise ValueError(
            f"a {ACTOR_NAME} actor already runs in {where} and {watched}, not "
            f"default_local_dir={default_local_dir!r}. Create it with this root "
            "before anything asks for it without one, give this job a Ray namespace "
            "of its own, or pass the same default_local_dir"
        )
