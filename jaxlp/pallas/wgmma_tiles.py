"""Tiling shared by the Pallas WGMMA GEMMs with swapped operands (``Y^T = W X^T``: weight rows
on WGMMA's M, 64 per instruction, tokens on its N): :mod:`jaxlp.pallas.nvfp4_matmul`,
:mod:`jaxlp.pallas.nestedfp_matmul` and :mod:`jaxlp.pallas.fp8_matmul`. Each kernel's config
subclasses :class:`Tiles` and adds its own checks of ``tile_m`` / ``tile_k``; the last two share
the persistent loop over CTA tiles (:func:`persistent_tiles`)."""

from __future__ import annotations

import dataclasses

import jax

WGMMA_ROWS = 64
SMEM_LIMIT = 227 * 1024  # bytes of shared memory a Hopper CTA can use


@dataclasses.dataclass(frozen=True)
class Tiles:
    """tile_n: weight rows per consumer warpgroup (WGMMA M; 64, 128, 192 or 256).
    tile_m: tokens per consumer warpgroup (WGMMA N). tile_k: K per pipeline step.
    stages: pipeline depth (shared-memory buffers per operand).
    wg_split: how the two consumer warpgroups share the CTA tile: ``"n"`` (each its own weight
        rows, both the same tokens: CTA tile ``tile_m x 2*tile_n``) or ``"m"`` (the same weight
        rows, each its own tokens: CTA tile ``2*tile_m x tile_n``).
    grid_minor: ``"m"`` or ``"n"``: the tile dimension that varies fastest in the persistent
        loop; grid_tile_width: width of the snake over the other dimension (L2 reuse)."""

    tile_n: int = 64
    tile_m: int = 128
    tile_k: int = 64
    stages: int = 4
    wg_split: str = "n"
    grid_minor: str = "m"
    grid_tile_width: int = 8

    def __post_init__(self):
        if self.tile_n % WGMMA_ROWS or not 64 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be 64, 128, 192 or 256, got {self.tile_n}")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"stages must be in [2, 8], got {self.stages}")
        if self.wg_split not in ("n", "m"):
            raise ValueError(f"wg_split must be 'n' or 'm', got {self.wg_split!r}")
        if self.grid_minor not in ("n", "m"):
            raise ValueError(f"grid_minor must be 'n' or 'm', got {self.grid_minor!r}")
        if self.grid_tile_width < 1:
            raise ValueError(f"grid_tile_width must be >= 1, got {self.grid_tile_width}")

    @property
    def cta_tile_n(self) -> int:
        return self.tile_n * (2 if self.wg_split == "n" else 1)

    @property
    def cta_tile_m(self) -> int:
        return self.tile_m * (2 if self.wg_split == "m" else 1)

    @property
    def name(self) -> str:
        return (f"N{self.tile_n}M{self.tile_m}K{self.tile_k}S{self.stages}{self.wg_split}"
                f"{self.grid_minor}{self.grid_tile_width}")

    def padded_shape(self, m: int, n: int, k: int) -> tuple[int, int, int]:
        """(M', N', K'): the shape a kernel runs (multiples of the CTA tile and of tile_k)."""
        return round_up(m, self.cta_tile_m), round_up(n, self.cta_tile_n), round_up(k, self.tile_k)

    def check_smem(self, kernel: str) -> None:
        """ValueError naming ``kernel`` where the config's ``smem_bytes()`` passes a CTA's limit."""
        if self.smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"{kernel}: config {self.name} needs {self.smem_bytes()} bytes of shared memory "
                             f"(> {SMEM_LIMIT}): fewer stages or smaller tiles")


def tile_slices(cfg: Tiles, lin, m_iters: int, n_iters: int, wg):
    """Work item ``lin`` of a persistent loop over the ``m_iters x n_iters`` CTA tiles (a planar
    snake, ``cfg.grid_minor`` fastest): ``(cta_m, cta_n, wg_m, wg_n)``, the CTA's token and weight-row
    slices and warpgroup ``wg``'s slices within them."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    grid_minor = 1 if cfg.grid_minor == "n" else 0
    mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), grid_minor, cfg.grid_tile_width)
    tn, tm = cfg.tile_n, cfg.tile_m
    cta_m = pl.ds(mi * cfg.cta_tile_m, cfg.cta_tile_m)
    cta_n = pl.ds(ni * cfg.cta_tile_n, cfg.cta_tile_n)
    split_n = cfg.wg_split == "n"
    wg_m = pl.ds(0, tm) if split_n else pl.ds(wg * tm, tm)
    wg_n = pl.ds(wg * tn, tn) if split_n else pl.ds(0, tn)
    return cta_m, cta_n, wg_m, wg_n


def pipeline(cfg: Tiles, k_iters: int, in_specs):
    """``get_pipeline(body, compute_context)``: the kernels' K loop of ``k_iters`` steps over
    ``in_specs``, warp-specialized (a third warpgroup with 40 registers issues the copies, two
    consumer warpgroups ``"wg"``), ``cfg.stages`` steps in flight."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.stages,
            compute_context=compute_context,
        )

    return get_pipeline


def persistent_tiles(cfg: Tiles, get_pipeline, operands, m_iters: int, n_iters: int, tile) -> None:
    """Inside a warp-specialized kernel: the buffers of the pipeline ``get_pipeline(body,
    compute_context)`` builds (its allocations for the GMEM ``operands``) scoped over the
    warpgroups, then this SM's share of the persistent loop over the ``m_iters x n_iters`` CTA
    tiles, calling ``tile(wg, (cta_m, cta_n, wg_m, wg_n), allocs)`` for each (:func:`tile_slices`)."""
    import functools

    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ignore = lambda *_, **__: None  # noqa: E731

    @functools.partial(pl.run_scoped, allocs=get_pipeline(ignore, ignore).get_allocations(*operands),
                       collective_axes="wg")
    def _scope(allocs):
        wg = jax.lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(info):
            tile(wg, tile_slices(cfg, info.index[0], m_iters, n_iters, wg), allocs)


def zeros(shape) -> jax.Array:
    """FP32 zeros ``shape`` in the WGMMA accumulator layout (inside a kernel)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.numpy as jnp

    return plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), plgpu.Layout.WGMMA)


def accumulate(promote: bool, shape, eval_pipeline, epilogue) -> None:
    """Runs a K pipeline whose steps accumulate ``shape`` FP32 sums, then ``epilogue(sums)``: with
    ``promote`` the sums are registers the steps carry (each adds its own WGMMA sums,
    :func:`promoted_step`), else one WGMMA accumulator the steps' WGMMAs add into (waited for
    before the epilogue)."""
    import functools

    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.numpy as jnp

    if promote:
        epilogue(eval_pipeline(zeros(shape)))
        return

    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(shape, jnp.float32))
    def _acc(acc_ref):
        eval_pipeline(acc_ref)
        plgpu.wgmma_wait(0)
        epilogue(acc_ref[...])


def promoted_step(carry: jax.Array, issue) -> jax.Array:
    """``carry`` plus this step's sums: ``issue(acc_ref)`` issues the step's WGMMAs into an
    accumulator that starts from zero (the tensor cores' FP8 sums stay within one step)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return carry + pl.run_state(issue)(plgpu.ACC.init(zeros(carry.shape)))


def store_transposed(y, out_smem, y_dst, chunk: int) -> None:
    """``y [rows, tokens]`` (registers, the swapped operands' accumulator layout) to ``y_dst
    [tokens, rows]`` (GMEM) as ``y^T``, ``chunk`` tokens at a time through ``out_smem [chunk, rows]``."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    for e in range(y.shape[1] // chunk):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem.T[...] = y[:, e * chunk:(e + 1) * chunk]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, y_dst.at[pl.ds(e * chunk, chunk)])


def round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def num_sms() -> int:
    """The default device's SM count (132 where it does not say)."""
    dev = jax.devices()[0]
    return getattr(dev, "core_count", None) or 132
