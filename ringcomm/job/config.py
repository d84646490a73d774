"""Settings: one frozen object built from ``RINGCOMM_*`` environment variables.

Nothing else in ringcomm reads tuning knobs from the environment.  Unknown
``RINGCOMM_*`` variables are an error, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from . import horovod_env, ports
from ..errors import InvalidInputError

#: Variables that describe the job (set by the launcher), not tuning knobs.
TOPOLOGY_VARS = frozenset(
    {
        "RINGCOMM_RANK",
        "RINGCOMM_SIZE",
        "RINGCOMM_LOCAL_RANK",
        "RINGCOMM_LOCAL_SIZE",
        "RINGCOMM_CROSS_RANK",
        "RINGCOMM_CROSS_SIZE",
        "RINGCOMM_RENDEZVOUS_ADDR",
        "RINGCOMM_SECRET",
        "RINGCOMM_JOB_ID",
        "RINGCOMM_HOSTNAME",
        "RINGCOMM_RENDEZVOUS_PORT",
        "RINGCOMM_MASTER_ADDR",
        "RINGCOMM_NETWORK_INTERFACE",
        "RINGCOMM_INSECURE",
    }
)
#: Set by ringcomm-run's elastic driver (ringcomm/elastic).
TOPOLOGY_VARS |= {"RINGCOMM_ELASTIC_WORKER", "RINGCOMM_ELASTIC_TIMEOUT"}


def _flag(raw: str) -> bool:
    """A boolean setting: 1/true/yes/on or 0/false/no/off/empty; anything else is a ValueError."""
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


#: Most payload bytes rank 0 takes in for one op on the rank-0 path, summed over the ranks.
SMALL_ALLREDUCE_RANK0_BYTES = 1024 * 1024
#: Recursive doubling's default bound (see :meth:`Settings.doubling_allreduce_bytes_for`).
DOUBLING_ALLREDUCE_BYTES = 256 * 1024
#: The small-op lane by job size: its bound for reductions lies between these, its region within the last.
LANE_MIN_BYTES, LANE_MAX_BYTES, LANE_REGION_BYTES = 64 * 1024, 2 * 1024 * 1024, 16 * 1024 * 1024
#: ... and its bound for the ops that only move data (broadcast, allgather, alltoall), its region within
#: the last where /dev/shm has room (:func:`ringcomm.shm.space.lane_payload_bytes`).
LANE_MOVE_MAX_BYTES, LANE_MOVE_REGION_BYTES = 8 * 1024 * 1024, 64 * 1024 * 1024
#: The lane across hosts sends each payload to every other rank: by default it runs in jobs of up to
#: this many ranks, for payloads up to NET_LANE_RANK_BYTES / ranks.
NET_LANE_MAX_RANKS, NET_LANE_RANK_BYTES = 8, 128 * 1024
#: The most threads per rank the shared-memory allreduce takes by default (4 measured on 16 cores).
MAX_AUTO_MEMORY_THREADS = 4


@dataclasses.dataclass(frozen=True)
class Settings:
    """Tuning knobs.  Field ``x`` is read from ``RINGCOMM_X``."""

    #: Largest fused buffer, in bytes (Horovod's HOROVOD_FUSION_THRESHOLD).
    fusion_threshold: int = 64 * 1024 * 1024
    #: DistributedOptimizer (no ``groups=`` given): gradients are reduced in buckets of about this
    #: many bytes (DDP's ``bucket_cap_mb``; the first bucket at most 1 MiB, so communication starts
    #: early), filled in reverse parameter order (the order backward produces them); each bucket
    #: starts its reduction once all its gradients are ready.  0: one op per parameter.
    bucket_bytes: int = 25 * 1024 * 1024
    #: DistributedOptimizer's CUDA buckets, in a job where some host runs two ranks or more and the
    #: GPUs of each host's ranks are one or have peer access: reduced on the GPUs through CUDA IPC,
    #: each rank summing its shard of its host's ranks' buckets, and only that shard crossing hosts
    #: (``ringcomm_torch/device_ipc.py``; not in an elastic job); 0: always through pinned host
    #: memory.  On one H200 shared by two ranks, resnet18 training at batch 64 ran at 6831 img/s
    #: this way and 4568 through pinned memory.
    device_ipc: bool = True
    #: With the device path on, each rank shares one device buffer of this many bytes with the other
    #: ranks of its host, once, at its first CUDA allreduce (``ringcomm_torch/device_arena.py``):
    #: per-tensor allreduces (``hvd.allreduce``, SyncBatchNorm, the ``"ringcomm"`` backend) that fit in
    #: what is free reduce there; the others go through pinned host memory.
    device_ipc_arena_bytes: int = 256 * 1024 * 1024
    #: Per-tensor CUDA allreduces and broadcasts smaller than this many bytes go through pinned host memory even
    #: with the device path on.  On one H200 shared by two ranks an allreduce through the arena took
    #: about 1.5 ms whatever its size up to 64 MiB (64 MiB: 1.71 ms, 25x gloo), and through pinned
    #: memory 0.67 ms at 4 KiB and 1.17 ms at 1 MiB (measured on another day): they cross near 2 MiB.
    device_ipc_min_bytes: int = 2 * 1024 * 1024
    #: How a rank waits for another rank's device work on the device path: ``stream`` (its side
    #: stream waits for the peer's event; no host thread waits) or ``host`` (a return thread, or
    #: ``synchronize()``, waits for the event before queuing what depends on it, so that no stream
    #: of this process ever waits on another process's work).  Alike on every rank.
    device_ipc_wait: str = "stream"
    #: The torch layer's new CPU tensors of 4 MiB and more (out-of-place results, converting copies)
    #: come from blocks it reuses once their tensors are gone, as torch's CUDA allocator does: a
    #: fresh block's pages are mapped at first write (a 1 GiB result took 1.6x the allreduce itself).
    #: This many bytes of unused blocks are kept at most, each for at most a minute (0: none kept).
    host_cache_bytes: int = 1 << 30
    #: Milliseconds the coordinator waits to batch more ready ops into one fused response (0: none).
    cycle_time: float = 0.0
    #: Bytes per pipelined segment on the ring (and per shared-memory slot): fewer, larger segments
    #: mean fewer wake-ups per op; 4 MiB measured faster than 1 MiB across hosts and no slower on one.
    segment_bytes: int = 4 * 1024 * 1024
    #: Bytes per pipelined segment instead, on a ring whose every link joins two hosts (each rank
    #: on a host of its own): those links are TCP streams, where a segment costs a wake-up of three
    #: threads and no slot; 8 MiB measured 2-9% faster than 4 MiB at 64 MiB over 10 Gbit/s.  Rank 0
    #: warns at ``init()`` when such a job sets RINGCOMM_SEGMENT_BYTES alone.
    stream_segment_bytes: int = 8 * 1024 * 1024
    #: Segments smaller than this are copied into ZeroMQ messages; larger ones are sent zero-copy.
    zero_copy_min_bytes: int = 64 * 1024
    #: ZeroMQ I/O threads per process.
    io_threads: int = 1
    #: Kernel socket buffer size for data-plane sockets, in bytes (0: the OS default).
    socket_buffer_bytes: int = 0
    #: ``LOW-HIGH``: every TCP port the job listens on (each rank's data, stream and lane sockets,
    #: rank 0's control socket, the launcher's rendezvous) is one of these, for a firewall that opens
    #: only some ports; set the same on every host (``job/ports.py``).  Empty: any free port.
    port_range: str = ""
    #: Payloads of at least this many bytes for a rank on another host go over a TCP connection per
    #: direction of their own, written from and read into the arrays with no ZeroMQ copy
    #: (``net/streams.py``; 0: every payload on ZeroMQ; off when RINGCOMM_ENCRYPT is set).
    stream_min_bytes: int = 256 * 1024
    #: Payloads of at least this many bytes for a rank on the same host are read by that rank straight
    #: from the sender's memory (``process_vm_readv``: one copy instead of two through a shared-memory
    #: slot) where the host allows it; elsewhere they take the slots (``shm/cross_memory.py``; 0: never).
    cross_memory_min_bytes: int = 2 * 1024 * 1024
    #: Shared-memory slots per direction between ranks on one host (0: sockets only); each holds a
    #: segment, so a pair of ranks maps at most 2 x slots x segment bytes (32 MiB by default), fewer
    #: where /dev/shm has less room (a ring takes at most 1/(2 x the host's ranks) of what is free).
    shm_slots: int = 4
    #: Segments smaller than this travel inside ZeroMQ messages even on one host.
    shm_min_bytes: int = 64 * 1024
    #: Allreduces of at least this many bytes, in a job whose ranks all share one host, go through
    #: one shared-memory region instead of the ring (``shm_allreduce.py``; 0: always the ring).
    shm_allreduce_min_bytes: int = 1024 * 1024
    #: ... and only in jobs of at least this many ranks.
    shm_allreduce_min_ranks: int = 2
    #: Bytes of its buffer each rank puts into the shared region per round (the region holds
    #: 2 x (ranks + 1) such slabs).
    shm_allreduce_piece_bytes: int = 4 * 1024 * 1024
    #: Threads per rank for that allreduce's copies and sums, each on its own range of the piece
    #: (``memory_threads.py``; results bitwise the same, and ranks may differ).  0, the default:
    #: by the cores each rank has, :meth:`shm_allreduce_threads_for`.
    shm_allreduce_threads: int = 0
    #: In a job whose ranks all share one host, allreduces, reducescatters, broadcasts, allgathers
    #: and alltoalls of the global set with payloads up to this many bytes (and barriers) go through
    #: the shared-memory lane: every rank computes the result from the others' posted payloads, no
    #: engine, no rank 0 (``lane/driver.py``; 0: never; -1: by job size, :meth:`shm_lane_bytes_for`
    #: for the reductions and :meth:`shm_lane_move_bytes_for` for the others).
    shm_lane_bytes: int = -1
    #: In a job that spans hosts, the same ops up to this many bytes go through the lane across
    #: hosts: each rank sends its entry to every other rank over TCP and computes the result
    #: itself (``net_lane.py``; 0, the default: off; -1: by job size, :meth:`net_lane_bytes_for`).
    #: Off by default: every op of the global set, small or not, then costs each rank a TCP send
    #: to every peer, which made larger ops slower (2 hosts: 1 MiB 1.23 vs 1.07 ms).
    net_lane_bytes: int = 0
    #: Payloads up to this many bytes are reduced at rank 0 in one round trip instead of on the ring
    #: (-1: by job size: 16 KiB at 2 ranks, doubling per rank up to 128 KiB, and from 8 ranks on
    #: 1 MiB / ranks; :func:`small_allreduce_bytes_for`).
    small_allreduce_bytes: int = -1
    #: Allreduces past the rank-0 path's bound and up to this many bytes take recursive doubling
    #: (log2(ranks) exchanges of the whole buffer) instead of the ring's 2(ranks - 1) steps, where
    #: no shared-memory or hierarchical path takes them (0: never; -1: the default, 256 KiB,
    #: :meth:`doubling_allreduce_bytes_for`).
    doubling_allreduce_bytes: int = -1
    #: Allreduces in jobs that span hosts: reduce within each host, across hosts, then share within
    #: the host (1: whenever the layout allows it, 0: never, -1: from 1 MiB up; ``hierarchical.py``).
    hierarchical_allreduce: int = -1
    #: A hierarchical allreduce is cut into pieces of this many bytes (at most 8) whose phases
    #: within the host overlap the link's work on other pieces (0: one piece; ``hierarchical.py``).
    hierarchical_piece_bytes: int = 8 * 1024 * 1024
    #: Seconds to wait for a peer's data before declaring it lost.
    peer_timeout: float = 30.0
    #: Seconds every rank has to reach the rendezvous.
    start_timeout: float = 60.0
    #: Seconds after which rank 0 warns about an op only some ranks submitted, and again every
    #: such period while it waits, with the time waited so far (``inf``: never).
    stall_check_seconds: float = 60.0
    #: Seconds after which an op only some ranks submitted fails on every rank with ``StallError``:
    #: now on the ranks that wait, later on each late rank when it submits it; no rank's data is
    #: reduced, and the job goes on (0: wait for ever, Horovod's default; 1800, torch.distributed's
    #: process-group timeout, bounds a wait for a rank that never comes).
    stall_shutdown_seconds: float = 1800.0
    #: Entries in the response cache (0 disables it).
    cache_capacity: int = 1024
    #: Chrome-trace timeline path ("" for none).
    timeline: str = ""
    #: Mark each coordination cycle in the timeline.
    timeline_mark_cycles: bool = False
    #: ``init()`` without ``process_sets=`` allows add_process_set()/remove_process_set() later.
    dynamic_process_sets: bool = False
    #: Level of the ``ringcomm`` logger (DEBUG, INFO, WARNING, ERROR, CRITICAL), set by ``init()`` only
    #: when given; it then also adds a stderr handler if nothing shows ringcomm's records.  Empty: the
    #: application's logging configuration decides (``ringcomm/job/logsetup.py``).
    log_level: str = ""
    #: Encrypt the data and control planes (ZeroMQ CURVE, keys derived from the job secret).
    encrypt: bool = False
    #: The Horovod controller the job was started for ("gloo", "mpi", or "": none named; Horovod's
    #: HOROVOD_CONTROLLER, set by ``ringcomm-run``/``horovodrun --gloo`` or ``--mpi``).  ringcomm has one
    #: controller of its own; this only decides what ``gloo_enabled()`` and ``mpi_enabled()`` answer.
    controller: str = ""
    #: Likewise the library Horovod would run CPU collectives with ("gloo", "mpi", "ccl" or ""; Horovod's
    #: HOROVOD_CPU_OPERATIONS): ``gloo_enabled()`` is true when either names gloo, as in Horovod.
    cpu_operations: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Build settings from ``environ`` (default ``os.environ``); raises on unknown or malformed keys.

        Horovod's ``HOROVOD_*`` names are read too (:mod:`ringcomm.job.horovod_env`); a ``RINGCOMM_*``
        name set beside one wins.
        """
        env = os.environ if environ is None else environ
        given = env
        env = {**horovod_env.translate(env), **env}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, object] = {}
        for key, raw in env.items():
            if not key.startswith("RINGCOMM_") or key in TOPOLOGY_VARS:
                continue
            name = key[len("RINGCOMM_"):].lower()
            if name not in fields:
                known = ", ".join(sorted("RINGCOMM_" + n.upper() for n in fields))
                raise InvalidInputError(f"unknown setting {key}={raw!r}; known settings: {known}")
            default = fields[name].default
            kind: type = type(default)
            if kind in (int, float) and not raw.strip():
                continue  # a number set to nothing (a job file's X=${X:-}): the default, as if unset
            try:
                values[name] = kind(raw) if kind is not bool else _flag(raw)
            except ValueError:
                said = key if key in given else horovod_env.source(key, given)
                raise InvalidInputError(
                    f"{said}={raw!r} is not a valid {kind.__name__}" + (" (use 1 or 0)" if kind is bool else
                    f"; set {'a whole number' if kind is int else 'a number'} (the default: {said}={default}) "
                    f"or unset it")
                ) from None
        settings = cls(**values)  # type: ignore[arg-type]
        settings.validate()
        return settings

    @property
    def listen_ports(self) -> ports.PortRange | None:
        """The ports listening sockets may take (:data:`port_range`), or None: any free port."""
        return ports.parse(self.port_range)

    def shm_lane_bytes_for(self, size: int) -> int:
        """The small-op lane's bound in a job of ``size`` ranks: the setting, or by default 4 MiB /
        ``size``, between 64 KiB and 2 MiB, so the region (4 entries per rank) stays within 16 MiB.
        Measured at np 2, 3 and 4 against the ring and the shared-memory allreduce: faster at every
        size up to the bound (np=2 2 MiB 0.61 vs 1.07-1.16 ms, np=3 1.3 MiB 1.13 vs 1.53 ms).

            Settings().shm_lane_bytes_for(2) -> 2097152    ...(4) -> 1048576    ...(64) -> 65536
        """
        if self.shm_lane_bytes >= 0:
            return self.shm_lane_bytes
        return max(LANE_MIN_BYTES, min(LANE_MAX_BYTES, LANE_REGION_BYTES // (4 * max(1, size))))

    def shm_lane_move_bytes_for(self, size: int) -> int:
        """The lane's bound for the ops that only move data (broadcast, allgather, alltoall) in a job
        of ``size`` ranks: the setting, or by default 16 MiB / ``size``, at most 8 MiB and at least
        the reductions' bound (:meth:`shm_lane_bytes_for`), so the region stays within 64 MiB; it is
        the region's entry size, cut back towards the reductions' bound where /dev/shm has less
        room (:func:`ringcomm.shm.space.lane_payload_bytes`).  Each rank reads a peer's entry once,
        with no sum, so the lane stays ahead of the engine to larger sizes than for a reduction:
        at np 4 (2 cores) a 4 MiB broadcast 1.36-1.46 vs 3.2 ms, alltoall 2.1-2.2 vs 4.1 ms, while
        a 4 MiB allreduce was 4.1-4.4 vs 3.8-4.0 ms.

            Settings().shm_lane_move_bytes_for(2) -> 8388608    ...(4) -> 4194304    ...(64) -> 262144
        """
        if self.shm_lane_bytes >= 0:
            return self.shm_lane_bytes
        by_size = min(LANE_MOVE_MAX_BYTES, LANE_MOVE_REGION_BYTES // (4 * max(1, size)))
        return max(self.shm_lane_bytes_for(size), by_size)

    def shm_allreduce_threads_for(self, ranks: int, cores: int) -> int:
        """Threads per rank for the shared-memory allreduce when ``ranks`` ranks share a host that
        gives the job ``cores`` cores: the setting, or by default half of a rank's share of the
        cores (the rest feed the GPU, run autograd and the engine), between 1 and 4.  Measured: on
        16 cores with 2 ranks, 4 threads took a 64 MiB allreduce from 17.4 to 9.3 ms, and resnet18
        training on a shared H200 from 1.07x and 1.11x DDP-on-gloo's img/s (batch 64, 256) to 1.35x
        and 1.31x; with 2 ranks on 2 cores, 2 threads were 1.1-1.2x slower.

            Settings().shm_allreduce_threads_for(2, 16) -> 4    ...(4, 16) -> 2    ...(2, 2) -> 1
        """
        if self.shm_allreduce_threads > 0:
            return self.shm_allreduce_threads
        return max(1, min(MAX_AUTO_MEMORY_THREADS, cores // max(1, ranks) // 2))

    def net_lane_bytes_for(self, size: int) -> int:
        """The lane's bound across hosts in a job of ``size`` ranks: the setting (0, the default: off),
        or with -1 128 KiB / ``size`` up to 8 ranks (each rank sends every payload to each of the
        others, so its bytes on the wire grow with the size) and off past 8 ranks.

            Settings(net_lane_bytes=-1).net_lane_bytes_for(2) -> 65536    ...(4) -> 32768    ...(16) -> 0
        """
        if self.net_lane_bytes >= 0:
            return self.net_lane_bytes
        return NET_LANE_RANK_BYTES // size if 1 < size <= NET_LANE_MAX_RANKS else 0

    def small_allreduce_bytes_for(self, size: int) -> int:
        """The rank-0 path's bound in a job of ``size`` ranks: the setting, or by default 16 KiB at
        2 ranks, doubling with each rank up to 128 KiB, and from 8 ranks on 1 MiB / ``size``.

        Rank 0 receives every payload and sends every result, so its cost grows with the size
        while the ring's grows with its 2(p-1) steps; measured crossovers (np=2: 16-32 KiB, np=3:
        32-64 KiB, np=4: 64-128 KiB) lie at or just above this rule's bound.  Past 8 ranks the
        bound shrinks so that rank 0 never takes in more than 1 MiB of payloads per op, whatever
        the job's size (at 4,096 ranks: 256 bytes, a few scalars).

            Settings().small_allreduce_bytes_for(2) -> 16384    ...(4) -> 65536    ...(8) -> 131072
            Settings().small_allreduce_bytes_for(64) -> 16384   ...(4096) -> 256
        """
        if self.small_allreduce_bytes >= 0:
            return self.small_allreduce_bytes
        return min(128 * 1024, (16 * 1024) << max(0, size - 2), SMALL_ALLREDUCE_RANK0_BYTES // max(1, size))

    def doubling_allreduce_bytes_for(self, size: int) -> int:
        """Recursive doubling's bound in a job of ``size`` ranks: the setting, or by default
        :data:`DOUBLING_ALLREDUCE_BYTES` whatever the size (with a size that is not a power of two, the
        extra ranks' hand-over adds two exchanges: at 3 ranks 3 in all against the ring's 4 steps).

            Settings().doubling_allreduce_bytes_for(4) -> 262144
        """
        if self.doubling_allreduce_bytes >= 0:
            return self.doubling_allreduce_bytes
        return DOUBLING_ALLREDUCE_BYTES if size > 1 else 0

    def validate(self) -> None:
        """Raise :class:`InvalidInputError` for values that cannot work."""
        if self.fusion_threshold < 0:
            raise InvalidInputError(f"RINGCOMM_FUSION_THRESHOLD must be >= 0, got {self.fusion_threshold}")
        if self.host_cache_bytes < 0:
            raise InvalidInputError(f"RINGCOMM_HOST_CACHE_BYTES must be >= 0 (0: keep no blocks), got "
                                    f"{self.host_cache_bytes}")
        if self.device_ipc_arena_bytes < 0:
            raise InvalidInputError(f"RINGCOMM_DEVICE_IPC_ARENA_BYTES must be >= 0 (0: every per-tensor CUDA allreduce "
                                    f"through pinned host memory), got {self.device_ipc_arena_bytes}")
        if self.device_ipc_min_bytes < 0:
            raise InvalidInputError(f"RINGCOMM_DEVICE_IPC_MIN_BYTES must be >= 0 (0: every per-tensor CUDA allreduce "
                                    f"that fits through the arena), got {self.device_ipc_min_bytes}")
        if self.device_ipc_wait not in ("stream", "host"):
            raise InvalidInputError(f"RINGCOMM_DEVICE_IPC_WAIT must be 'stream' or 'host', got {self.device_ipc_wait!r}")
        if self.segment_bytes < 1024:
            raise InvalidInputError(f"RINGCOMM_SEGMENT_BYTES must be >= 1024, got {self.segment_bytes}")
        if self.stream_segment_bytes < 1024:
            raise InvalidInputError(f"RINGCOMM_STREAM_SEGMENT_BYTES must be >= 1024, got {self.stream_segment_bytes}")
        if self.stream_min_bytes < 0:
            raise InvalidInputError(f"RINGCOMM_STREAM_MIN_BYTES must be >= 0 (0: no streams), got {self.stream_min_bytes}")
        if self.cross_memory_min_bytes < 0:
            raise InvalidInputError(f"RINGCOMM_CROSS_MEMORY_MIN_BYTES must be >= 0 (0: payloads on one host through "
                                    f"shared memory only), got {self.cross_memory_min_bytes}")
        if self.shm_allreduce_min_bytes < 0 or self.shm_allreduce_piece_bytes < 1024:
            raise InvalidInputError(
                "RINGCOMM_SHM_ALLREDUCE_MIN_BYTES must be >= 0 and RINGCOMM_SHM_ALLREDUCE_PIECE_BYTES >= 1024, got "
                f"{self.shm_allreduce_min_bytes} and {self.shm_allreduce_piece_bytes}"
            )
        if not 0 <= self.shm_allreduce_threads <= 64:
            raise InvalidInputError(
                f"RINGCOMM_SHM_ALLREDUCE_THREADS must be between 0 (by cores) and 64, got {self.shm_allreduce_threads}")
        if self.shm_allreduce_min_ranks < 2:
            raise InvalidInputError(f"RINGCOMM_SHM_ALLREDUCE_MIN_RANKS must be >= 2, got {self.shm_allreduce_min_ranks}")
        if self.peer_timeout <= 0 or self.start_timeout <= 0:
            raise InvalidInputError("RINGCOMM_PEER_TIMEOUT and RINGCOMM_START_TIMEOUT must be > 0")
        if self.log_level.strip().upper() not in ("", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise InvalidInputError(
                f"RINGCOMM_LOG_LEVEL={self.log_level!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL "
                "(or leave it empty: the application's logging configuration decides)"
            )
        if self.hierarchical_piece_bytes < 0:
            raise InvalidInputError(
                f"RINGCOMM_HIERARCHICAL_PIECE_BYTES must be >= 0 (0: no pieces), got {self.hierarchical_piece_bytes}")
        if self.hierarchical_allreduce not in (-1, 0, 1):
            raise InvalidInputError(
                f"RINGCOMM_HIERARCHICAL_ALLREDUCE must be 1 (on), 0 (off) or -1 (by size), got {self.hierarchical_allreduce}")
        if self.shm_lane_bytes < -1 or self.shm_lane_bytes > 64 * 1024 * 1024:
            raise InvalidInputError(
                f"RINGCOMM_SHM_LANE_BYTES must be between 0 (off) and 64 MiB (or -1: by job size), got "
                f"{self.shm_lane_bytes}")
        if self.net_lane_bytes < -1 or self.net_lane_bytes > 4 * 1024 * 1024:
            raise InvalidInputError(
                f"RINGCOMM_NET_LANE_BYTES must be between 0 (off) and 4 MiB (or -1: by job size), got "
                f"{self.net_lane_bytes}")
        if self.small_allreduce_bytes < -1:
            raise InvalidInputError(
                f"RINGCOMM_SMALL_ALLREDUCE_BYTES must be >= 0 (or -1: by job size), got {self.small_allreduce_bytes}")
        if self.doubling_allreduce_bytes < -1:
            raise InvalidInputError(
                f"RINGCOMM_DOUBLING_ALLREDUCE_BYTES must be >= 0 (or -1: the default), got {self.doubling_allreduce_bytes}")
        for var, value, allowed in (("RINGCOMM_CONTROLLER", self.controller, ("gloo", "mpi")),
                                    ("RINGCOMM_CPU_OPERATIONS", self.cpu_operations, ("gloo", "mpi", "ccl"))):
            if value.strip().lower() not in ("", *allowed):
                raise InvalidInputError(
                    f"{var}={value!r} (or its HOROVOD_* name): use {', '.join(allowed)} or leave it empty")
        if self.cycle_time < 0:
            raise InvalidInputError(f"RINGCOMM_CYCLE_TIME must be >= 0, got {self.cycle_time}")
        try:
            ports.parse(self.port_range)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None


def port_range(environ: Mapping[str, str]) -> ports.PortRange | None:
    """``RINGCOMM_PORT_RANGE`` of ``environ`` alone, for a launcher's own rendezvous (the other settings
    are the ranks' to read and check); raises :class:`InvalidInputError` for a malformed one."""
    try:
        return ports.parse(environ.get(ports.VAR, ""))
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None


#: Settings that decide how an op's data is cut and which path it takes.  Ranks that held different
#: values would wait for segments, pieces or paths their peers never use: ``init()`` compares them.
AGREED = ("segment_bytes", "stream_segment_bytes", "hierarchical_allreduce", "hierarchical_piece_bytes",
          "shm_allreduce_min_bytes", "shm_allreduce_piece_bytes", "shm_allreduce_min_ranks", "small_allreduce_bytes",
          "doubling_allreduce_bytes")


def segment_setting_unused(environ: Mapping[str, str], one_per_host: bool) -> str | None:
    """What to warn when ``RINGCOMM_SEGMENT_BYTES`` is set for a job whose ring it does not cut: with every
    rank on a host of its own (``one_per_host``) the ring's segments are ``RINGCOMM_STREAM_SEGMENT_BYTES``.
    None when there is nothing to say.

    >>> segment_setting_unused({"RINGCOMM_SEGMENT_BYTES": "1048576"}, True)[:40]
    'RINGCOMM_SEGMENT_BYTES=1048576 does not '
    >>> segment_setting_unused({"RINGCOMM_SEGMENT_BYTES": "1048576"}, False) is None
    True
    """
    value = environ.get("RINGCOMM_SEGMENT_BYTES")
    if value is None or not one_per_host or "RINGCOMM_STREAM_SEGMENT_BYTES" in environ:
        return None
    return (f"RINGCOMM_SEGMENT_BYTES={value} does not cut this job's ring: every rank is on a host of its own, "
            "so every link joins two hosts and the ring is cut into RINGCOMM_STREAM_SEGMENT_BYTES segments "
            f"({Settings.stream_segment_bytes} by default). Set RINGCOMM_STREAM_SEGMENT_BYTES={value} on every "
            "rank to cut it as you meant (RINGCOMM_SEGMENT_BYTES still cuts ops of process sets that share a host)")


def agreed(settings: Settings) -> dict[str, int]:
    """This rank's values of the :data:`AGREED` settings (what it publishes at the rendezvous)."""
    return {name: getattr(settings, name) for name in AGREED}


def check_agreed(table: list[dict], rank: int) -> None:
    """Raise naming the first :data:`AGREED` setting on which the ranks of ``table`` differ.

    ``table``: every rank's rendezvous record, with ``rank`` and ``agreed`` (:func:`agreed`).
    """
    for name in AGREED:
        holders: dict[object, list[int]] = {}
        for peer in sorted(table, key=lambda p: int(p["rank"])):
            holders.setdefault(peer.get("agreed", {}).get(name), []).append(int(peer["rank"]))
        if len(holders) > 1:
            var = "RINGCOMM_" + name.upper()
            which = "; ".join(f"ranks {ranks} have {value}" for value, ranks in holders.items())
            raise InvalidInputError(
                f"rank {rank}: the ranks disagree on {var} ({which}). It decides how each op's data is cut and "
                f"which path it takes, so ranks that differ would wait for data that never comes. Set {var} (or "
                "its HOROVOD_* name) to the same value on every rank, or on none.")
