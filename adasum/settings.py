"""Every switch of the library, in one place, read from the environment once at import.

The settings are one immutable :class:`Settings` value. :func:`configure` replaces it (every rank must make
the same change: calls on ranks whose settings differ raise); :func:`current` reads it. A call reads the
settings once when it starts, so a change made by another thread never takes effect half-way through a call.

Environment variables (read at import, never again):

=============================  ==========================================================================
``ADASUM_SMALL_MESSAGE_BYTES`` ``small_message_bytes``: ``auto`` (default) or a number of bytes
``ADASUM_KERNELS``             ``kernels``: ``c`` (default; the compiled kernels where they were built) or
                               ``numpy``
``ADASUM_KERNELS_ISA``         ``kernels_isa``: ``auto`` (default), ``avx2`` or ``portable``
``ADASUM_NATIVE_MPI``          ``native_mpi``: ``1`` (default) or ``0``
``ADASUM_GPU_TRANSPORT``       ``gpu_transport``: ``auto`` (default), ``direct`` or ``staged``
``ADASUM_CUDA_AWARE``          ``cuda_aware``: ``1`` or ``0`` overrides what MPI reports
``ADASUM_DEVICE_KERNELS``      ``device_kernels``: ``auto`` (default), ``triton`` or ``per-layer``
``ADASUM_STALL_WARNING``       ``stall_warning``: seconds (default 60; ``off`` disables)
``ADASUM_STALL_TIMEOUT``       ``stall_timeout``: seconds (default ``off``)
``ADASUM_WAITING``             ``waiting``: ``auto`` (default), ``nap`` or ``spin``
``ADASUM_ELASTIC_REPLACE``     ``elastic_replace``: ``1`` or ``0`` (default)
``ADASUM_ELASTIC_REPLACE_``    ``elastic_replace_attempts`` (``…_ATTEMPTS``, default 3) and
                               ``elastic_replace_timeout`` (``…_TIMEOUT``, seconds, default 300)
=============================  ==========================================================================

The environment of other launchers (torchrun's ``WORLD_SIZE``, Slurm's ``SLURM_NTASKS``, …) is kept as it
was at import in :func:`launch_environment`; the working directory at import, where elastic training starts
processes in place of dead ranks, in :func:`start_directory`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Mapping

__all__ = ["Settings", "configure", "current", "get_small_message_bytes", "launch_environment",
           "set_small_message_bytes", "start_directory"]

_GPU_TRANSPORTS = ("auto", "direct", "staged")
_KERNELS = ("c", "numpy")
_KERNELS_ISAS = ("auto", "avx2", "portable")
_DEVICE_KERNELS = ("auto", "triton", "per-layer")
_WAITINGS = ("auto", "nap", "spin")
_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")
# Variables that tell whether (and how) the process was launched as part of a larger job.
_LAUNCH_PREFIXES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_",
                    "MASTER_ADDR", "MASTER_PORT", "SLURM_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCALNRANKS",
                    "HYDRA_", "MPIR_", "PALS_", "PBS_", "LSB_", "JSM_", "OMPI_COMM_WORLD_", "MV2_", "HOROVOD_",
                    "ADASUM_ELASTIC_NEWCOMER")  # the mark of a process spawned to replace a dead rank


@dataclass(frozen=True)
class Settings:
    """The library's switches. Every rank of a communicator must use the same values.

    Attributes:
        small_message_bytes: Adasum calls of at most this many bytes (all tensors together) exchange whole
            vectors by recursive doubling (log2 P message rounds); larger calls use recursive halving (about
            2·N bytes sent per rank). ``0`` always halves. ``None``: chosen from the world size (3 MiB for 2
            and 3 ranks, 1 MiB for 4 to 7, 1 MiB / (log2 P - 1) from 8 on) where the ranks share one
            host; across hosts, from 4 ranks, always halving, which puts fewer bytes on the links
            (:func:`adasum.call.plan.choose`). A number set here holds on one host and across hosts.
        kernels: ``"c"``: host float buffers (float32, float64, float16, bfloat16) go through the compiled kernels where they were built;
            ``"numpy"``: always the numpy kernels (same results to rounding; the compiled ones are faster).
        kernels_isa: the widest instruction set the compiled kernels use: ``"auto"`` (the widest the CPU has,
            AVX-512F or AVX2), ``"avx2"`` or ``"portable"`` (plain C). All of them give the same bits.
        native_mpi: the compiled kernels call the MPI library directly, where it can be bound: small calls
            on host buffers run their MPI calls and kernels in one compiled call, and every call's agreement
            is waited for there; off, the same steps run from Python through mpi4py, with the same messages
            and bits.
        gpu_transport: how device buffers reach MPI: ``"auto"`` (directly where MPI is CUDA-aware, else
            staged), ``"direct"`` or ``"staged"`` (copied through page-locked host buffers; applied to host
            buffers too, where it only adds a copy).
        cuda_aware: ``None``: ask MPI (``MPIX_Query_cuda_support``); ``True``/``False`` overrides the answer.
        device_kernels: the dot products and combine of device buffers: ``"auto"``: the segmented Triton
            kernels (:mod:`adasum.kernels.segmented`, a few kernels per level for all layers) on CUDA devices where
            triton imports, else the per-layer torch/cupy kernels; ``"triton"``: the Triton kernels for
            every torch and cupy buffer, CPU tensors included (there they need triton's interpreter,
            ``TRITON_INTERPRET=1``); ``"per-layer"``: always the per-layer kernels. The ranks check that they
            agree on it (the two paths round differently); under ``"auto"`` every rank needs the same
            environment (triton importable everywhere or nowhere).
        direct_min_bytes: from this many bytes per call, halving reads separate host tensors where they lie
            (and an in-place call combines in them) instead of packing them into one buffer.
        split_min_bytes: from this many bytes per call, halving on separate tensors cuts each exchange into
            one message per layer piece of at least ``chunk_bytes`` (MPI sends fastest from contiguous memory).
        chunk_bytes: the smallest layer piece that travels as a message of its own when exchanges are cut.
        plain_direct_bytes: ``sum`` and ``mean`` of host tensors: a tensor of at least this many bytes is
            reduced by MPI where it lies (no copy); smaller ones are packed into one message per dtype
            (:mod:`adasum.call.plain`). ``0`` packs every tensor. The ranks check that they agree on it.
        stall_warning: seconds a rank waits for the others at the start of a call before the library logs
            which ranks have not arrived (``None``: never).
        stall_timeout: seconds after which every waiting rank raises ``AdasumStallError`` (``None``: never).
        waiting: how the library waits for its messages (:mod:`adasum.runtime.waiting`): ``"nap"`` polls for a
            few microseconds, then between short sleeps, so that a rank's compute keeps its core;
            ``"spin"`` polls without pause, as MPI's blocking calls do (the fastest where nothing else needs
            the core: shared-memory transfers of megabytes took 1.6× as long napping); ``"auto"``: nap on
            the communicators of the overlap thread, which waits while backward runs, spin elsewhere.
        elastic_replace: elastic training under ULFM starts as many processes as died, at the first commit
            after a shrink, so that the world grows back to its launch size (:mod:`adasum.torch.elastic`).
        elastic_replace_attempts: failed attempts at growing back (one per commit) after which the survivors
            stop trying and go on at their size, until another rank dies.
        elastic_replace_timeout: seconds the survivors wait for the processes they started to reach
            ``elastic.run``; past it that attempt has failed.
    """

    small_message_bytes: int | None = None
    kernels: str = "c"
    kernels_isa: str = "auto"
    native_mpi: bool = True
    gpu_transport: str = "auto"
    cuda_aware: bool | None = None
    device_kernels: str = "auto"
    direct_min_bytes: int = 2 << 20
    split_min_bytes: int = 2 << 20
    chunk_bytes: int = 256 << 10
    plain_direct_bytes: int = 128 << 10
    stall_warning: float | None = 60.0
    stall_timeout: float | None = None
    waiting: str = "auto"
    elastic_replace: bool = False
    elastic_replace_attempts: int = 3
    elastic_replace_timeout: float = 300.0

    def __post_init__(self) -> None:
        for name in ("direct_min_bytes", "split_min_bytes", "chunk_bytes", "plain_direct_bytes"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0 bytes, got {getattr(self, name)}")
        if self.small_message_bytes is not None and int(self.small_message_bytes) < 0:
            raise ValueError(f"small message threshold must be >= 0 bytes, got {self.small_message_bytes}")
        if self.kernels not in _KERNELS:
            raise ValueError(f"kernels backend must be 'c' or 'numpy', got {self.kernels!r}")
        if self.kernels_isa not in _KERNELS_ISAS:
            raise ValueError(f"kernels_isa must be one of {_KERNELS_ISAS}, got {self.kernels_isa!r}")
        if self.device_kernels not in _DEVICE_KERNELS:
            raise ValueError(f"device kernels must be one of {_DEVICE_KERNELS}, got {self.device_kernels!r}")
        if self.waiting not in _WAITINGS:
            raise ValueError(f"waiting must be one of {_WAITINGS}, got {self.waiting!r}")
        if self.gpu_transport not in _GPU_TRANSPORTS:
            raise ValueError(f"gpu transport must be one of {_GPU_TRANSPORTS}, got {self.gpu_transport!r}")
        for name in ("stall_warning", "stall_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
        if not isinstance(self.elastic_replace, bool):
            raise ValueError(f"elastic_replace must be True or False, got {self.elastic_replace!r}")
        if isinstance(self.elastic_replace_attempts, bool) or int(self.elastic_replace_attempts) < 1:
            raise ValueError(f"elastic_replace_attempts must be at least 1, got {self.elastic_replace_attempts!r}")
        if not float(self.elastic_replace_timeout) > 0:
            raise ValueError(f"elastic_replace_timeout must be a positive number of seconds, got "
                             f"{self.elastic_replace_timeout!r}")

    def small_message_limit(self, size: int) -> int:
        """The schedule threshold in effect for a communicator of ``size`` ranks."""
        if self.small_message_bytes is not None:
            return self.small_message_bytes
        k = size.bit_length() - 1
        if k <= 1:
            return 3 << 20  # one pair after the fold: both schedules send N bytes per rank
        return (1 << 20) // (k - 1)

    def agreed(self) -> tuple[tuple[str, int], ...]:
        """The settings that change the messages or the rounding of an Adasum call: the ranks check them in
        every call (ranks on different device kernels would round differently, and their replicas drift)."""
        return (("small-message bytes", -1 if self.small_message_bytes is None else self.small_message_bytes),
                ("chunk bytes", self.chunk_bytes),
                ("device kernels", _DEVICE_KERNELS.index(self.device_kernels)))


def _seconds(text: str | None, default: float | None) -> float | None:
    if text is None or text.strip() == "":
        return default
    text = text.strip().lower()
    return None if text in _FALSE or text == "none" else float(text)


def _flag(text: str | None) -> bool | None:
    if text is None or text.strip() == "":
        return None
    text = text.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"expected 1/0, true/false, yes/no or on/off, got {text!r}")


def from_environment(env: Mapping[str, str]) -> Settings:
    """The settings that ``env`` (the process environment at import) asks for."""
    small = env.get("ADASUM_SMALL_MESSAGE_BYTES", "auto").strip().lower()
    native = _flag(env.get("ADASUM_NATIVE_MPI"))
    return Settings(
        small_message_bytes=None if small in ("", "auto") else int(small),
        kernels=env.get("ADASUM_KERNELS", "c").strip().lower() or "c",
        kernels_isa=env.get("ADASUM_KERNELS_ISA", "auto").strip().lower() or "auto",
        native_mpi=True if native is None else native,
        gpu_transport=env.get("ADASUM_GPU_TRANSPORT", "auto").strip().lower() or "auto",
        cuda_aware=_flag(env.get("ADASUM_CUDA_AWARE")),
        device_kernels=env.get("ADASUM_DEVICE_KERNELS", "auto").strip().lower() or "auto",
        stall_warning=_seconds(env.get("ADASUM_STALL_WARNING"), 60.0),
        stall_timeout=_seconds(env.get("ADASUM_STALL_TIMEOUT"), None),
        waiting=env.get("ADASUM_WAITING", "auto").strip().lower() or "auto",
        elastic_replace=_flag(env.get("ADASUM_ELASTIC_REPLACE")) is True,
        elastic_replace_attempts=int(env.get("ADASUM_ELASTIC_REPLACE_ATTEMPTS", "").strip() or 3),
        elastic_replace_timeout=_seconds(env.get("ADASUM_ELASTIC_REPLACE_TIMEOUT"), 300.0) or 300.0,
    )


class _Holder:
    """The current settings and the launch environment: the library's only process-wide switches."""

    def __init__(self, env: Mapping[str, str]):
        self.value = from_environment(env)
        # triton's own switch: its interpreter runs kernels on CPU tensors (device_kernels="triton" there)
        self.triton_interpret = _flag(env.get("TRITON_INTERPRET")) is True
        self.launch = {k: v for k, v in env.items() if k.startswith(_LAUNCH_PREFIXES)}
        try:
            self.directory = os.getcwd()
        except OSError:
            self.directory = None
        self.launch_verified = False  # the launch check passed (adasum.runtime.launch.check_launch)
        self.lock = threading.Lock()


_holder = _Holder(os.environ)


def current() -> Settings:
    """The settings in effect now."""
    return _holder.value


def configure(settings: Settings | None = None, **changes) -> Settings:
    """Replace the settings (by a whole :class:`Settings`, or by some of its fields) and return the previous
    ones, so that a caller can put them back: ``old = adasum.configure(chunk_bytes=64); …;
    adasum.configure(old)``. Raises ValueError (and changes nothing) for an invalid value.

    Every rank must make the same change: an Adasum call on ranks whose schedule settings differ raises
    ``AdasumMismatchError`` on every rank.
    """
    with _holder.lock:
        old = _holder.value
        new = settings if settings is not None else old
        if changes:
            unknown = set(changes) - {f.name for f in dataclasses.fields(Settings)}
            if unknown:
                raise TypeError(f"unknown setting(s) {', '.join(sorted(unknown))}; the settings are "
                                f"{', '.join(f.name for f in dataclasses.fields(Settings))}")
            new = dataclasses.replace(new, **changes)
        _holder.value = new
        return old


def triton_interpreted() -> bool:
    """Whether triton's interpreter was switched on (``TRITON_INTERPRET=1`` at import): only then do
    triton's kernels take CPU tensors."""
    return _holder.triton_interpret


def launch_verified() -> bool:
    """Whether this process's launch was checked and found right (:func:`adasum.runtime.launch.check_launch`)."""
    return _holder.launch_verified


def set_launch_verified() -> None:
    _holder.launch_verified = True


def export_environment(env: Mapping[str, object]) -> None:
    """Set variables of this process's environment (for what ``torch.distributed`` and frameworks read,
    such as ``MASTER_ADDR``); the settings and the launch environment kept at import stay as they were."""
    os.environ.update({k: str(v) for k, v in env.items()})


def launch_environment() -> dict[str, str]:
    """The launcher-related environment variables (torchrun, Slurm, MPI process managers) at import."""
    return dict(_holder.launch)


def environment_variables(*names: str) -> dict[str, str]:
    """The process environment's variables whose names start with one of ``names``, read now (for the
    environment report: the settings themselves are read once, at import)."""
    return {k: v for k, v in os.environ.items() if k.startswith(names)}


def start_directory() -> str | None:
    """The working directory at import (None where it could not be read)."""
    return _holder.directory


def set_small_message_bytes(nbytes: int | None) -> None:
    """Adasum calls of at most ``nbytes`` (all tensors together) exchange whole vectors by recursive
    doubling, in log2(P) message rounds; larger calls use recursive halving, which sends about 2·N bytes
    per rank instead of log2(P)·N but makes about three times the rounds. ``0`` always uses halving.
    ``None`` (the default; ``ADASUM_SMALL_MESSAGE_BYTES=auto``) picks the threshold from the world size
    (:meth:`Settings.small_message_limit`). The setting ``small_message_bytes`` of :func:`configure`.

    Every rank must use the same setting: a call on ranks that differ raises AdasumMismatchError.
    """
    configure(small_message_bytes=None if nbytes is None else int(nbytes))


def get_small_message_bytes() -> int | None:
    """The threshold set with :func:`set_small_message_bytes` (None: chosen from the world size)."""
    return current().small_message_bytes
