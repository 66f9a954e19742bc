"""Which Ray cluster a run's ``ray.init`` joins, and whether the launcher lets it (docs/training.md
"Multi-node", docs/security.md).

verl 0.9.1 calls ``ray.init(**ray_kwargs.ray_init)`` (``verl/trainer/main_ppo.py``); Ray 2.60 takes
``RAY_ADDRESS`` when that ``address`` is unset or ``auto``, else the ``address`` itself
(``ray/_private/worker.py``, ``init``; ``ray/_private/services.py``,
``canonicalize_bootstrap_address``). :func:`join_target` reads both doors the same way, from the
composed config. A join is allowed only when the driver holds a private token and the cluster itself
refuses a client that sends none (:func:`cluster_has_token_auth`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from search_env.retrieval.auth import AuthFileError, load_tokens

ADDRESS_KEY = "ray_kwargs.ray_init.address"
"""verl's key for ``ray.init``'s ``address`` (``+ray_kwargs.ray_init.address=...`` adds it)."""
ADDRESS_ENV = "RAY_ADDRESS"
RAY_INSECURE_KEY = "launch.ray_insecure_no_auth"
MULTI_NODE_DOCS = 'docs/training.md "Multi-node"'
PROBE_TIMEOUT_S = 10.0
"""Seconds the cluster's GCS gets to answer (or refuse) the launcher's call without a token."""
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""A private Ray's environment: Ray's switch for single-machine clusters
(``ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR``). Off, the node's IP is 127.0.0.1
(``ray._private.services.get_node_ip_address``), and the GCS, raylet and agents listen on loopback
only (measured: docs/security.md)."""
AUTH_FIX = (
    "Start every node with `export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<a token file at mode 600>` "
    f"before `ray start`, and this launcher with the same exports ({MULTI_NODE_DOCS})"
)


class JoinRefused(ValueError):
    """The run must not join this cluster; the message names the door and the fix."""


@dataclass(frozen=True)
class Join:
    """A Ray cluster the trainer's ``ray.init`` would join, and the door that named it."""

    door: str
    address: str

    def __str__(self) -> str:
        return f"{self.door}={self.address}"


def join_target(env: Mapping[str, str], config: DictConfig | None) -> Join | None:
    """The cluster ``ray.init`` joins with ``env`` and the composed ``config``, resolved as Ray does;
    None when it starts a private instance (no address, or ``local``). An explicit ``address``
    wins over ``RAY_ADDRESS``."""
    key = OmegaConf.select(config, ADDRESS_KEY) if config is not None else None
    if env.get(ADDRESS_ENV) and key in (None, "auto"):
        join = Join(ADDRESS_ENV, env[ADDRESS_ENV])
    elif key is None:
        return None
    else:
        join = Join(ADDRESS_KEY, str(key))
    return None if join.address == "local" else join


def token_mode(env: Mapping[str, str]) -> bool:
    """``RAY_AUTH_MODE=token`` in ``env``, any case, as Ray reads it."""
    return (env.get("RAY_AUTH_MODE") or "").lower() == "token"


def driver_problem(join: Join, env: Mapping[str, str], insecure_ok: bool) -> str | None:
    """Why this driver must not join ``join``, or None (token auth on with a token only its owner
    can read). Ray's driver sends a token only with ``RAY_AUTH_MODE=token`` in its own environment
    when the address is explicit; the token is ``RAY_AUTH_TOKEN``, else the file
    ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``. ``insecure_ok`` (:data:`RAY_INSECURE_KEY`)
    allows a driver without auth, never a token file others can read."""
    if not token_mode(env):
        if insecure_ok:
            return None
        return (
            f"{join}: joining a Ray cluster without token authentication (RAY_AUTH_MODE is "
            f"{env.get('RAY_AUTH_MODE') or 'unset'}, not token): anyone who can reach its ports runs code on its nodes. "
            f"{AUTH_FIX}, or set {RAY_INSECURE_KEY}=true to join a cluster "
            "without auth anyway"
        )
    if env.get("RAY_AUTH_TOKEN"):
        return None
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    path = env.get("RAY_AUTH_TOKEN_PATH") or str(home / ".ray" / "auth_token")
    try:
        load_tokens(path)
    except AuthFileError as err:
        return f"{join}: RAY_AUTH_MODE=token, but Ray's {err} ({MULTI_NODE_DOCS})"
    return None


def cluster_has_token_auth(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the GCS at ``address`` (host:port) refuses a gRPC call that carries no token
    (``NodeInfoGcsService.GetClusterId``, Ray's own stub; no proxy); False when it answers.
    ConnectionError when nothing answers within ``timeout_s`` seconds."""
    import grpc  # heavy (with Ray below): imported only when a run joins a cluster
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc  # heavy: imports ray

    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            raise ConnectionError(f"{err.code().name}: {err.details()}") from None
    return False


def check_join(
    join: Join, env: Mapping[str, str], insecure_ok: bool, timeout_s: float = PROBE_TIMEOUT_S
) -> str:
    """A line for the log when this run may join ``join``; JoinRefused otherwise: an address the
    launcher cannot check (``auto``, ``ray://``), :func:`driver_problem`, a cluster that does not
    answer, or one that answers a client without a token (unless ``insecure_ok``)."""
    if join.address == "auto":
        raise JoinRefused(
            f"{join}: `auto` joins whichever Ray runs on this machine; name the head's GCS address "
            f"(<head>:6379) instead ({MULTI_NODE_DOCS})"
        )
    if "://" in join.address:
        raise JoinRefused(
            f"{join}: the launcher joins a cluster through its GCS, not Ray Client; name the head's "
            f"GCS address (<head>:6379) instead ({MULTI_NODE_DOCS})"
        )
    if problem := driver_problem(join, env, insecure_ok):
        raise JoinRefused(problem)
    try:
        token_auth = cluster_has_token_auth(join.address, timeout_s)
    except ConnectionError as err:
        raise JoinRefused(
            f"{join}: no Ray GCS answered within {timeout_s:g} s ({err}); start the head first, or fix "
            "the address"
        ) from None
    if token_auth:
        if not token_mode(env):
            raise JoinRefused(
                f"{join}: the cluster requires a token, and this launcher sends none. {AUTH_FIX}"
            )
        return f"joining the Ray cluster at {join} (it refuses clients without a token)"
    if not insecure_ok:
        raise JoinRefused(
            f"{join}: that Ray cluster answers a client that sends no token (its nodes were started "
            f"without RAY_AUTH_MODE=token): anyone who can reach its ports runs code on its nodes. "
            f"{AUTH_FIX}, or set {RAY_INSECURE_KEY}=true to join it anyway"
        )
    return f"WARNING: joining {join}, a Ray cluster without token auth ({RAY_INSECURE_KEY}=true)"
