"""The typed configuration: one frozen pydantic model per component.

Every component receives its own slice (``Runtime(config.runtime)``), never a pile of
keyword arguments. Times carry their unit in the name; all timeouts live in
``TimeoutsConfig``. The commented default file is ``config/default.toml`` at the top of
the repository; ``config/schema.json`` is generated from these models.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from volunteerd import uids
from volunteerd.config.addrs import is_dialable_addr, is_ed25519_peer_id, peer_multiaddr_problem

__all__ = [
    "CONFIG_VERSION",
    "MAX_GRID_DIMENSION",
    "CheckpointConfig",
    "Config",
    "DHTConfig",
    "ExperimentsConfig",
    "ExpertsConfig",
    "GuardConfig",
    "HardwareConfig",
    "LimitsConfig",
    "LoggingConfig",
    "NetworkConfig",
    "OptimizerConfig",
    "PeerLimitsConfig",
    "ReachabilityConfig",
    "ReplicasConfig",
    "RuntimeConfig",
    "ScheduleConfig",
    "TimeoutsConfig",
    "WireLimits",
]

CONFIG_VERSION: Final = 1
# The next coordinates one prefix record may list, as every peer accepts them by default
# (``dht.max_children_per_record``): the widest grid dimension experts can be found in.
# A record of more is refused by storing peers, readers and this node's own store.
MAX_GRID_DIMENSION: Final = 256


class _Model(BaseModel):
    # No setting means infinity or NaN (TOML spells them inf and nan, and pydantic would
    # also take the strings "inf" and "nan" for a float): an infinite limit or period
    # only breaks arithmetic and JSON later, far from the key that caused it. Strict: a
    # value of the wrong type is refused, not converted (``port = true`` was port 1,
    # ``upload_mbit = "5"`` 5); an integer is still a number.
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False, strict=True
    )


# A peer to dial: protocol/value pairs (/ip4/1.2.3.4/tcp/38400, /dns/host/tcp/1...),
# ending in /p2p/ and its peer id (base58: 12D3KooW... or Qm...), that multiaddr reads
# so too (``_check_peer_multiaddrs``).
_PEER_MULTIADDR = r"(/[a-z0-9-]+/[^/\s]+)+/p2p/[1-9A-HJ-NP-Za-km-z]{40,60}"


def _check_peer_multiaddrs(values: list[str], what: str) -> list[str]:
    """Each of ``values`` a peer's multiaddr as the network layer will parse it
    (``net.peers.parse_peer_multiaddr``): a shape that only looked right (``/unix/a/p2p/
    <id>``, where the socket path takes in the /p2p/ part; an unknown protocol; an IP
    out of range) started a daemon that then stopped with a traceback."""
    for value in values:
        problem = None
        if not re.fullmatch(_PEER_MULTIADDR, value):
            problem = "it does not end in /p2p/<peer id>"
        else:
            problem = peer_multiaddr_problem(value)
        if problem is not None:
            raise ValueError(
                f"not a {what} multiaddr: {value!r}: {problem} (expected "
                "/ip4/<address>/tcp/<port>/p2p/<peer id>, as the peer prints it)"
            )
    return values


class NetworkConfig(_Model):
    """Where this node listens and how it joins the swarm."""

    listen_host: str = Field(
        "0.0.0.0",
        description="IP address to listen on (0.0.0.0 = every IPv4 interface; :: = every "
        "interface of both families, where IPv6 sockets take IPv4 too, Linux's default)",
    )
    port: int = Field(38400, ge=0, le=65535, description="TCP port; 0 picks a free one")
    max_connections: int = Field(
        1000,
        ge=32,
        le=100_000,
        description="open connections at once, inbound and outbound (a tenth is kept for "
        "this node's own dials), and never more than the open-file limit less 64; idle "
        "inbound ones are closed when over half of the inbound slots are taken",
    )
    announce_addrs: list[str] = Field(
        default_factory=list,
        description="multiaddrs to advertise instead of the listening ones (e.g. after "
        "forwarding a port on the router)",
    )
    bootstrap_peers: list[str] = Field(
        default_factory=list,
        description="multiaddrs of peers to join through, each ending in /p2p/<peer id>",
    )

    @field_validator("listen_host")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"not an IP address: {value!r}") from None
        return value

    @field_validator("announce_addrs")
    @classmethod
    def _multiaddrs(cls, values: list[str]) -> list[str]:
        # The records' own rule: a /dns4 name or 0.0.0.0 here started a node whose
        # records carried nothing a peer could dial, and port 99999 a traceback.
        for value in values:
            if not is_dialable_addr(value):
                raise ValueError(
                    f"{value!r} is not an address peers can dial: use "
                    "/ip4/<public IP>/tcp/<port> (or /ip6/..., or a relay's "
                    "/p2p/<relay id>/p2p-circuit address); names (/dns4/...) are not "
                    "announced, and 0.0.0.0, multicast addresses or ports outside 1-65535 "
                    "cannot be dialled"
                )
        return values

    @field_validator("bootstrap_peers")
    @classmethod
    def _peer_multiaddrs(cls, values: list[str]) -> list[str]:
        # Checked here, before anything starts: a peer without its id is only refused
        # by libp2p after the node is up (and its identity created).
        return _check_peer_multiaddrs(values, "peer's")


class DHTConfig(_Model):
    """Announcing experts in the DHT and storing other peers' announcements."""

    announce_period_s: float = Field(
        15.0, gt=0, le=3600, description="how often a server re-announces its experts"
    )
    record_ttl_s: float = Field(
        30.0,
        gt=0,
        le=7200,
        description="lifetime of an announcement; a stopped server's "
        "experts vanish from lookups after at most this long",
    )
    replication: int = Field(5, ge=1, le=20, description="peers that store each record")
    max_record_ttl_s: float = Field(
        600.0, gt=0, description="longest record lifetime accepted from other peers"
    )
    max_clock_skew_s: float = Field(
        30.0, ge=0, description="how far in the future a record's issue time may be"
    )
    max_records_per_key: int = Field(
        512,
        ge=1,
        le=16384,
        description="servers remembered per key; when full, a newcomer is refused rather "
        "than displacing a server seen for longer",
    )
    max_keys: int = Field(
        100_000, ge=1, description="expert records (so keys) this node stores for others"
    )
    max_children_per_record: int = Field(
        MAX_GRID_DIMENSION,
        ge=1,
        le=4096,
        description="next coordinates one prefix record may list (the largest grid "
        "dimension this node stores records for)",
    )
    max_records_per_writer: int = Field(
        1024, ge=1, description="keys one announcing peer may hold records under"
    )
    store_budget_mb: float = Field(
        64.0,
        gt=0,
        description="memory for records stored for others: three quarters for expert "
        "records, one quarter for experiment manifests",
    )
    peer_quota_mb: float = Field(
        4.0, gt=0, description="of that, what one peer's connection may fill"
    )
    ip_prefix_quota_mb: float = Field(
        16.0,
        gt=0,
        description="of that, what peers from one IPv4 /24 or IPv6 /48 may fill together",
    )
    max_manifests: int = Field(
        1024, ge=1, le=100_000, description="experiment manifests this node stores for others"
    )
    max_owners_per_name: int = Field(
        16,
        ge=1,
        le=16,
        description="owners whose manifests this node stores per experiment name; when "
        "full, a newcomer is refused rather than displacing an owner seen for longer",
    )
    max_manifests_per_owner: int = Field(
        16, ge=1, le=1024, description="experiment names one owner may store manifests for"
    )
    max_manifest_ttl_s: float = Field(
        30 * 86400.0,
        gt=0,
        description="longest lifetime accepted for an experiment manifest stored for others",
    )

    @model_validator(mode="after")
    def _ttl_outlives_period(self) -> Self:
        if self.record_ttl_s <= self.announce_period_s:
            raise ValueError(
                f"record_ttl_s ({self.record_ttl_s}) must be longer than announce_period_s "
                f"({self.announce_period_s}), or announcements lapse between refreshes"
            )
        if self.record_ttl_s > self.max_record_ttl_s:
            raise ValueError("record_ttl_s must not exceed max_record_ttl_s")
        return self


class OptimizerConfig(_Model):
    """The optimizer each hosted expert updates its own weights with."""

    name: Literal["adam", "sgd"] = Field("adam", description='"adam" or "sgd"')
    lr: float = Field(1e-3, gt=0, le=10, description="learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="adam only: each in [0, 1)")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd only")
    # At most 1: past that the decay outweighs any gradient (an outside audit found a
    # manifest's 1e308 accepted; SGD turned every weight infinite at the first step).
    weight_decay: float = Field(0.0, ge=0, le=1, description="at most 1")

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_a_list(cls, value: object) -> object:
        # TOML and JSON have lists, not tuples; strict validation takes tuples only
        return tuple(value) if isinstance(value, list) else value

    @field_validator("betas")
    @classmethod
    def _betas_below_one(cls, value: tuple[float, float]) -> tuple[float, float]:
        # torch refuses others only when the expert is built: a daemon that passed
        # `config validate` then failed to start (and a manifest with them, every
        # volunteer who joined, with "unreachable").
        if not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError(f"each of betas must be in [0, 1), not {list(value)}")
        return value


class ExpertsConfig(_Model):
    """Which experts this daemon hosts, and their architecture."""

    uids: str = Field(
        "",
        description='experts to host, a grid pattern, comma-separated (e.g. "ffn.[0:4].[0:4]"); '
        '"" = none: host the experiments of the projects joined (`volunteerd join`)',
    )
    type: Literal["ffn", "transformer"] = Field(
        "ffn", description='built-in architecture: "ffn" or "transformer"'
    )
    hidden_dim: int = Field(1024, ge=8, le=65536, description="width of inputs and outputs")
    num_heads: int = Field(8, ge=1, le=256, description="transformer only")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of activations and gradients on the wire"
    )
    seed: int = Field(0, ge=0, description="initial weights are derived from seed and uid")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)

    @field_validator("uids")
    @classmethod
    def _pattern(cls, value: str) -> str:
        # expand_pattern raises ValueError naming the bad part. A prefix over
        # MAX_GRID_DIMENSION children made a record every peer refused, this node's own
        # store too, and nothing said so: none of its experts could be found.
        prefix, children = _widest_prefix(uids.expand_pattern(value))
        if children > MAX_GRID_DIMENSION:
            raise ValueError(
                f"{children} experts under {prefix!r}; at most {MAX_GRID_DIMENSION} along one "
                f"grid dimension (what peers accept in one DHT record, "
                "dht.max_children_per_record)"
            )
        return value

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> Self:
        if self.type == "transformer" and self.hidden_dim % self.num_heads:
            raise ValueError(
                f"hidden_dim ({self.hidden_dim}) must be a multiple of num_heads ({self.num_heads})"
            )
        return self

    def uid_list(self) -> list[str]:
        return uids.expand_pattern(self.uids)


def _widest_prefix(uid_list: list[str]) -> tuple[str, int]:
    """The DHT prefix (``"ffn."``, ``"ffn.3."``) with the most next coordinates among
    ``uid_list``, and how many (0 for no uids)."""
    children: dict[str, set[int]] = {}
    for uid in uid_list:
        name, coords = uids.split_uid(uid)
        prefix = f"{name}."
        for coord in coords[:-1]:
            children.setdefault(prefix, set()).add(coord)
            prefix = f"{prefix}{coord}."
        children.setdefault(prefix, set()).add(coords[-1])
    return max(
        ((key, len(c)) for key, c in children.items()), key=lambda kc: kc[1], default=("", 0)
    )


class GuardConfig(_Model):
    """What an expert accepts from trainers: bounds on the inputs and gradients they
    send, statistical filtering of the gradients, a check after every optimizer step that
    undoes one that breaks the weights, and bans for the trainers to blame, so that one
    faulty or malicious trainer cannot wreck the weights that everybody shares."""

    window: int = Field(
        256, ge=8, le=100_000, description="recent gradient row norms each expert remembers"
    )
    warmup: int = Field(
        16, ge=1, description="gradient rows (samples) seen before outliers are judged"
    )
    max_deviations: float = Field(
        8.0,
        gt=0,
        description="a gradient row whose norm exceeds median + this many robust standard "
        "deviations (1.4826 MAD) is an outlier",
    )
    outliers: Literal["clip", "reject"] = Field(
        "clip",
        description='"clip": scale outlier rows down to the threshold; "reject": refuse '
        "the whole request",
    )
    reject_ratio: float = Field(
        100.0,
        gt=1,
        description="a request whose largest row norm is this many times the threshold "
        "is refused even when clipping",
    )
    # Absolute bounds hold from the first request (the statistics need warmup rows).
    # Honest activations of the built-in (pre-norm, residual) experts stay below ~1e4 and
    # honest output gradients below ~1 (7e4 with fp16 loss scaling); float32 squares
    # overflow above 1.8e19, which is what turned a single request into NaN weights.
    max_input_abs: float = Field(
        1e6,
        gt=0,
        le=1e15,
        description="largest |value| accepted in an input; a request with a larger one is refused",
    )
    max_gradient_abs: float = Field(
        1e6,
        gt=0,
        le=1e15,
        description="largest |value| accepted in an output gradient (after clipping); a "
        "request with a larger one is refused",
    )
    check_steps: bool = Field(
        True,
        description="refuse or undo an optimizer step that makes a weight or optimizer "
        "state non-finite or moves the weights by more than max_step_ratio (a step its "
        "bounds vouch for costs one or two norms; any other a copy of one expert's weights and "
        "optimizer state)",
    )
    full_check_every: int = Field(
        100,
        ge=0,
        description="give every Nth optimizer step of an expert the full check (copy, "
        "measure, undo if refused) even when its bounds vouch for it; 0 = only when they "
        "do not",
    )
    max_step_ratio: float = Field(
        1.0,
        gt=0,
        description="the most one optimizer step may move an expert's weights, as a "
        "fraction of their norm (all parameters together); a larger step is refused or undone",
    )
    ban_s: float = Field(
        600.0,
        ge=0,
        description="how long a trainer blamed for an undone step is refused (every "
        "request, every expert of this daemon); 0 = never refused",
    )
    blame_ratio: float = Field(
        10.0,
        gt=1,
        description="in an undone step merged from several trainers' requests, only the "
        "loudest few (at most half, by address) are blamed, and only if their largest "
        "gradient row norm is this many times the next trainer's",
    )


class HardwareConfig(_Model):
    """How much of this machine volunteerd may use for experts."""

    memory_budget_mb: int = Field(
        0,
        ge=0,
        description="memory for hosted experts, in MiB; 0 = half of the available memory "
        "(CPU; within a memory cgroup's limit) or 80% of the GPU's",
    )


class RuntimeConfig(_Model):
    """The compute device, batching and queueing."""

    device: str = Field("auto", description='"auto", "cpu", "cuda", "cuda:N" or "mps"')
    max_batch_size: int = Field(
        2048, ge=1, le=1 << 20, description="samples the batcher puts into one batch"
    )
    max_batch_wait_s: float = Field(
        0.005, ge=0, le=10, description="how long a batch waits for more requests"
    )
    queue_size: int = Field(
        64, ge=1, le=100_000, description="requests waiting per expert; beyond it: busy"
    )
    fair_share: bool = Field(
        True,
        description="share the device fairly among the peers' addresses: while a lighter "
        "one's requests wait, one that used far more of it recently waits, and a full queue "
        "takes a request from whoever holds the most places in it",
    )
    torch_threads: int = Field(0, ge=0, le=1024, description="0 = torch's default")
    priority: Literal["low", "normal"] = Field(
        "low",
        description='"low": the daemon runs at nice 10 and a low I/O priority, so that the '
        'computer stays responsive (the service files say the same); "normal": as started',
    )
    retain_activations_mb: int = Field(
        1024,
        ge=0,
        description="memory for forward passes kept for their backward (0 = always "
        "recompute, as Learning@home's stateless backward)",
    )
    retain_s: float = Field(
        60.0, gt=0, description="how long a kept forward waits for its backward"
    )
    stack_experts: Literal["auto", "always", "never"] = Field(
        "auto",
        description="compute the batches of many experts of one type and size as one (their "
        'weights stacked): "auto" = on a GPU, where it saves kernel launches (on a CPU it '
        "costs more than it saves)",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        head, _, index = value.partition(":")
        if head not in {"auto", "cpu", "cuda", "mps"} or (
            index and (head != "cuda" or not index.isdigit())
        ):
            raise ValueError(f'unknown device {value!r}: use "auto", "cpu", "cuda:0" or "mps"')
        return value


class WireLimits(_Model):
    """Caps on what a peer may send; checked before anything is allocated."""

    max_header_bytes: int = Field(64 * 1024, ge=1024, le=16 << 20, description="JSON header")
    max_body_bytes: int = Field(256 << 20, ge=1024, le=4 << 30, description="tensor bytes")
    max_tensors: int = Field(128, ge=1, le=1024, description="tensors in one message")
    max_sequence_length: int = Field(
        4096,
        ge=1,
        le=1 << 20,
        description="length of a sequence (a transformer expert's second dimension) in a "
        "request; attention costs its square",
    )
    max_request_samples: int = Field(8192, ge=1, le=1 << 20, description="samples a request")
    max_inflight_mib: int = Field(
        1024,
        ge=1,
        le=1 << 20,
        description="declared bytes of requests being read or answered at once, with their "
        "replies until written, all peers together (over it: busy); one request always fits "
        "an idle server",
    )


class TimeoutsConfig(_Model):
    """Every timeout, in seconds."""

    connect_s: float = Field(10.0, gt=0, description="open a connection and a stream")
    request_s: float = Field(60.0, gt=0, description="a peer answers a request")
    frame_read_s: float = Field(
        30.0, gt=0, description="a started frame must arrive completely within this"
    )
    stream_idle_s: float = Field(120.0, gt=0, description="server closes idle streams")
    connection_idle_s: float = Field(
        30.0,
        gt=0,
        description="an inbound connection with no stream this long is closed while over "
        "half of the inbound slots (network.max_connections, capped by the open-file "
        "limit, less a tenth) are taken",
    )
    pool_idle_s: float = Field(60.0, gt=0, description="client drops pooled idle streams")
    dht_rpc_s: float = Field(5.0, gt=0, description="one DHT store or find request")
    dht_lookup_s: float = Field(15.0, gt=0, description="a whole DHT lookup")
    shutdown_grace_s: float = Field(5.0, ge=0, le=600, description="drain work on stop")

    @model_validator(mode="after")
    def _pool_expires_first(self) -> Self:
        if self.pool_idle_s >= self.stream_idle_s:
            raise ValueError(
                "pool_idle_s must be shorter than stream_idle_s, or clients reuse streams "
                "the server is closing"
            )
        return self


class CheckpointConfig(_Model):
    """Saving each hosted expert's weights and optimizer state to the data folder."""

    enabled: bool = Field(True, description="load checkpoints on start and save them")
    every_s: float = Field(
        300.0, gt=0, le=86400, description="how often experts whose weights changed are saved"
    )
    keep: int = Field(
        2, ge=1, le=100, description="checkpoints kept per expert (older ones are deleted)"
    )


class ReplicasConfig(_Model):
    """Reconciling the weights of experts that several daemons host (replicas)."""

    enabled: bool = Field(True, description="average with other daemons hosting the same uid")
    average_every_s: float = Field(
        30.0, gt=0, le=86400, description="how often each expert averages (jittered +/-20%)"
    )
    clip_ratio: float = Field(
        0.1,
        gt=0,
        le=10,
        description="centered clipping: another replica moves a tensor by at most this "
        "fraction of its norm, divided by the number of replicas",
    )
    max_peers: int = Field(8, ge=1, le=64, description="replicas averaged with per round")


class ExperimentsConfig(_Model):
    """Joining an experiment published in the DHT: which one, whose, and how many experts.

    With ``join`` set the daemon ignores ``experts.uids`` (and the architecture in
    ``experts``): the experiment's signed manifest says which experts exist and how
    they are built, and the daemon chooses which of them to host."""

    join: str = Field(
        "",
        max_length=64,
        pattern=r"^([a-z0-9][a-z0-9_.-]{0,63})?$",
        description="name of an experiment to join besides the projects joined with "
        '`volunteerd join` ("" = none)',
    )
    trusted_owners: list[str] = Field(
        default_factory=list,
        description="peer ids of the owners whose signed manifests this daemon accepts "
        "(`volunteerd publish` prints the owner's)",
    )
    max_experts: int = Field(
        128,
        ge=0,
        le=4096,
        description="experts to host at most, for all projects together (experts.uids "
        "naming more is refused); 0 = as many as fit memory (a project of tiny experts "
        "then has this computer host thousands)",
    )
    rebalance_every_s: float = Field(
        60.0, gt=0, le=86400, description="how often the choice of experts is revisited"
    )
    min_stay_s: float = Field(
        300.0, ge=0, description="an expert is hosted at least this long before moving"
    )
    republish_every_s: float = Field(
        3600.0, gt=0, description="how often a joined daemon stores the manifest again"
    )
    manifest_check_every_s: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="how often a joined daemon looks its experiment's manifest up again "
        "(it follows a newer one, and stops hosting an expired one)",
    )
    join_timeout_s: float = Field(
        60.0, gt=0, description="how long to look for the manifest before giving up"
    )

    @field_validator("trusted_owners")
    @classmethod
    def _peer_ids(cls, values: list[str]) -> list[str]:
        # as an invitation's owner is checked: anything else (a name, a multiaddr, a
        # peer id cut short) trusted nobody, and the join waited for a manifest in vain
        for value in values:
            if not is_ed25519_peer_id(value):
                shown = value if len(value) <= 80 else f"{value[:80]}…"
                raise ValueError(
                    f"not a peer id: {shown!r} (expected the owner's peer id, 12D3KooW... "
                    "of an Ed25519 key, as `volunteerd publish` prints it)"
                )
        return values


class PeerLimitsConfig(_Model):
    """Per-peer limits on what one peer may ask of this node; beyond them: rate_limited."""

    requests_per_s: float = Field(
        200.0, gt=0, description="requests per second a peer may send, sustained"
    )
    request_burst: int = Field(
        400, ge=1, description="requests a peer may send at once above that rate"
    )
    max_streams: int = Field(
        128, ge=1, le=100_000, description="inbound streams one peer may hold open at once"
    )
    inbound_mib_per_s: float = Field(
        256.0, gt=0, description="MiB per second of frames a peer may send, sustained"
    )
    inbound_burst_mib: float = Field(
        1024.0, gt=0, description="MiB of frames a peer may send at once above that rate"
    )
    per_address: float = Field(
        8.0,
        ge=0,
        le=100_000,
        description="the peers at one IP address (an IPv6 /64) share this many peers' "
        "worth of the limits above (requests, bytes, streams); 0 = no limit per address",
    )
    limit_loopback: bool = Field(
        False,
        description="apply the per-address limits to peers on loopback too (by default "
        "this machine's own processes, a local trainer or demo, are exempt)",
    )
    max_connections_per_address: int = Field(
        64,
        ge=1,
        le=100_000,
        description="inbound connections one IP address (an IPv6 /64) may hold open at once",
    )
    dht_messages_per_s: float = Field(
        50.0,
        gt=0,
        description="Kademlia messages per second a peer's are answered at, sustained "
        "(beyond that they wait; the peers at one address share per_address times as many)",
    )
    dht_message_burst: int = Field(
        250, ge=1, description="Kademlia messages a peer may send at once above that rate"
    )
    identify_ping_per_s: float = Field(
        2.0,
        gt=0,
        description="identify and ping streams, and pings, per second a peer's are answered "
        "at, sustained (beyond that they wait; per address: per_address times as many)",
    )
    identify_ping_burst: int = Field(
        20, ge=1, description="identify and ping streams and pings a peer may send at once"
    )
    streams_per_s: float = Field(
        50.0,
        gt=0,
        description="inbound streams per second a peer's are negotiated at, whatever their "
        "protocol, sustained (beyond that they wait; per address: per_address times as many)",
    )
    stream_burst: int = Field(
        250, ge=1, description="inbound streams a peer may open at once above that rate"
    )
    small_frames_per_s: float = Field(
        2000.0,
        gt=0,
        description="small Yamux frames (control frames, data frames under 1 KiB) per second "
        "a peer's connections are read at, sustained (beyond that reading waits; per "
        "address: per_address times as many)",
    )
    small_frame_burst: int = Field(
        10_000, ge=1, description="small Yamux frames a peer may send at once above that rate"
    )


class ReachabilityConfig(_Model):
    """Whether peers can dial this node directly, and the circuit relay fallback."""

    mode: Literal["auto", "direct", "relay"] = Field(
        "auto",
        description="auto: ask peers to dial back and use a relay only when none can; "
        "direct: never use a relay; relay: always reserve a relay slot and announce it",
    )
    relays: list[str] = Field(
        default_factory=list,
        description="relay multiaddrs ending in /p2p/<peer id>; empty = the bootstrap peers",
    )
    check_every_s: float = Field(
        600.0, gt=0, description="seconds between dial-back checks (and relay re-reservations)"
    )
    act_as_relay: bool = Field(
        False,
        description="relay circuits for peers that cannot be dialled (bootstrap nodes always "
        "do); turn on only on a node that is directly reachable",
    )
    listen: bool = Field(
        True,
        description="listen for direct TCP connections; false makes a relay-only node "
        "(requires mode = relay)",
    )
    hole_punching: bool = Field(
        True,
        description="turn connections made through a relay into direct ones where the NATs "
        "allow it (DCUtR: both sides dial each other at once)",
    )

    @field_validator("relays")
    @classmethod
    def _relay_multiaddrs(cls, values: list[str]) -> list[str]:
        return _check_peer_multiaddrs(values, "relay")

    @model_validator(mode="after")
    def _listen_needs_relay(self) -> Self:
        if not self.listen and self.mode != "relay":
            raise ValueError("reachability.listen = false requires reachability.mode = 'relay'")
        return self


# Upper bounds of the limits, far above any home connection, but low enough that the
# bytes they become (rates x 125,000, a quota x 10^9) stay exact, finite numbers. The
# control API's ``LimitsChange`` repeats them (control imports no config); a unit
# test keeps the two equal.
MAX_RATE_MBIT: Final = 100_000.0  # 100 Gbit/s
MAX_QUOTA_GB: Final = 1_000_000.0  # 1 PB a month


class LimitsConfig(_Model):
    """What this machine gives: bandwidth, transfer quotas, disk and compute.

    Limits changed at run time are written to ``limits.toml`` in the data folder, whose
    values then take the place of this section's (environment and flags still win).
    """

    upload_mbit: float = Field(
        0.0,
        ge=0,
        le=MAX_RATE_MBIT,
        description="upload limit in Mbit/s for all peers together (0 = none; at most 100,000)",
    )
    download_mbit: float = Field(
        0.0,
        ge=0,
        le=MAX_RATE_MBIT,
        description="download limit in Mbit/s for all peers together (0 = none; at most 100,000)",
    )
    monthly_quota_gb: float = Field(
        0.0,
        ge=0,
        le=MAX_QUOTA_GB,
        description="GB (10^9 bytes) sent and received per calendar month; when used up, "
        "serving pauses until the month ends (0 = no quota; at most 1,000,000)",
    )
    duty_cycle: float = Field(
        1.0,
        gt=0,
        le=1,
        description="share of time the device may compute (0.5: rest as long as each batch "
        "took; 1 = no rest)",
    )
    max_batch_size: int = Field(
        0, ge=0, le=1 << 20, description="samples joined into one batch at most (0 = no cap)"
    )
    daily_quota_gb: float = Field(
        0.0,
        ge=0,
        le=MAX_QUOTA_GB,
        description="GB (10^9 bytes) sent and received per day (local time); when used up, "
        "serving pauses until midnight (0 = no quota; at most 1,000,000)",
    )
    disk_budget_gb: float = Field(
        0.0,
        ge=0,
        le=MAX_QUOTA_GB,
        description="GB the checkpoints and downloaded shards in the data folder may take; "
        "fewer old checkpoints are kept, and a save that does not fit is skipped (0 = none)",
    )
    cpu_threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="CPU threads torch computes with, changeable while running "
        "(0 = torch's default)",
    )


# "HH:MM-HH:MM", a window of local time that may wrap midnight ("22:00-07:00")
_WINDOW = r"^([01][0-9]|2[0-3]):[0-5][0-9]-([01][0-9]|2[0-3]):[0-5][0-9]$"


class ScheduleConfig(_Model):
    """When this machine computes for the swarm: always, or only while nobody uses it,
    not on battery, within hours of the day. Outside them serving pauses gracefully."""

    run: Literal["always", "when_idle"] = Field(
        "always",
        description='"always", or "when_idle": only after nobody used keyboard or mouse '
        "for idle_minutes",
    )
    idle_minutes: float = Field(
        3.0, gt=0, le=1440, description="minutes without input before the computer is idle"
    )
    on_battery: bool = Field(
        False, description="compute while the computer runs on battery (false = pause)"
    )
    compute_hours: list[str] = Field(
        default_factory=list,
        description='windows of local time to compute in, "HH:MM-HH:MM", may wrap '
        'midnight (["22:00-07:00"]); empty = any time',
    )
    network_hours: list[str] = Field(
        default_factory=list,
        description="windows of local time to use the network in (serving, downloading "
        "experts, averaging replicas); empty = any time",
    )
    gpu: Literal["always", "when_idle"] = Field(
        "always",
        description='with the experts on a GPU: "always", or "when_idle" (only while '
        "nobody uses the computer)",
    )

    @field_validator("compute_hours", "network_hours")
    @classmethod
    def _windows(cls, values: list[str]) -> list[str]:
        for value in values:
            if not re.fullmatch(_WINDOW, value):
                raise ValueError(f'not a time window: {value!r} (expected "HH:MM-HH:MM")')
            start, end = value.split("-")
            if start == end:
                raise ValueError(
                    f"an empty time window: {value!r} (leave the list empty for any time)"
                )
        return values


class ControlConfig(_Model):
    """The local control API and dashboard (127.0.0.1 only; see docs/control-api.md)."""

    enabled: bool = Field(True, description="serve the control API and the dashboard")
    port: int = Field(
        38480, ge=0, le=65535, description="TCP port on 127.0.0.1 (0 = any free port)"
    )


class StatsConfig(_Model):
    """Contribution accounting in <data dir>/stats.sqlite3."""

    flush_s: float = Field(
        5.0, gt=0, le=300, description="seconds between writes (a crash loses at most this)"
    )
    keep_hourly_days: int = Field(
        14,
        ge=1,
        le=3650,
        description="hourly rows older than this (at least 7) are folded into daily rows",
    )


class LoggingConfig(_Model):
    """Log output (to stderr)."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO",
        description="DEBUG, INFO, WARNING or ERROR; DEBUG also shows py-libp2p's own logs "
        "(an identical line at most 3 times a minute)",
    )


class Config(_Model):
    version: Literal[1] = Field(CONFIG_VERSION, description="format of this file")
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    dht: DHTConfig = Field(default_factory=DHTConfig)
    experts: ExpertsConfig = Field(default_factory=ExpertsConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    checkpoints: CheckpointConfig = Field(default_factory=CheckpointConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    experiments: ExperimentsConfig = Field(default_factory=ExperimentsConfig)
    wire: WireLimits = Field(default_factory=WireLimits)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    peer_limits: PeerLimitsConfig = Field(default_factory=PeerLimitsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    reachability: ReachabilityConfig = Field(default_factory=ReachabilityConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    stats: StatsConfig = Field(default_factory=StatsConfig)

    @model_validator(mode="after")
    def _hosted_within_max_experts(self) -> Self:
        # The cap was applied only to joined projects (swarm/joiner.py): experts.uids of
        # 4,096 tiny experts started (in 67 s) with the default 128 and no message.
        # Ignored while joining an experiment, as experts.uids is.
        most = self.experiments.max_experts
        if self.experiments.join or not most or not self.experts.uids:
            return self
        count = len(self.experts.uid_list())
        if count > most:
            raise ValueError(
                f"experts.uids names {count} experts, more than experiments.max_experts "
                f"({most}): host fewer, or raise experiments.max_experts (0 = no cap)"
            )
        return self

    @model_validator(mode="after")
    def _own_records_fit_own_store(self) -> Self:
        # experts.uids is checked against what every peer accepts (256); a node that
        # accepts fewer children a record refuses its own prefix record as well.
        own = self.dht.max_children_per_record
        if self.experiments.join or not self.experts.uids or own >= MAX_GRID_DIMENSION:
            return self
        prefix, children = _widest_prefix(self.experts.uid_list())
        if children > own:
            raise ValueError(
                f"experts.uids names {children} experts under {prefix!r}, more than "
                f"dht.max_children_per_record ({own}): this node would refuse its own "
                "record of that prefix; host fewer, or raise the setting"
            )
        return self
