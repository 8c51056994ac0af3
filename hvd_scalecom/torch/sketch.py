"""The count sketch of Sketched SGD (Ivkin et al., NeurIPS 2019), on torch tensors.

A count sketch (Charikar, Chen & Farach-Colton 2002) of a vector ``v`` of ``d`` entries is a table of
``r`` rows by ``c`` columns: row j adds ``s_j(x) * v[x]`` into column ``h_j(x)``, with a bucket hash
``h_j: [d] -> [c]`` and a sign hash ``s_j: [d] -> {-1, +1}``. The estimate of ``v[x]`` is the median over
rows of ``s_j(x) * S[j, h_j(x)]``. The sketch is linear, ``S(a + b) = S(a) + S(b)``: workers can sum
their sketches with an allreduce and obtain the sketch of the summed vector. Heavy coordinates (large
``|v[x]|`` relative to ``||v||_2``) are recovered accurately when ``c`` is large enough.

The hashes are computed on the fly from the coordinate index, never stored per coordinate: row ``j`` has
three seeds ``(a_j, a'_j, b_j)``, drawn once from ``seed``. With ``p = 2**31 - 1`` (a prime) and the index
split into 30-bit limbs, ``x = x_0 + 2**30 x_1``:

    ``g_j(x) = (a_j x_0 + a'_j x_1 + b_j) mod p``  Carter & Wegman's inner-product family over Z_p:
                                                   ``g_j(x)``, ``g_j(y)`` independent and uniform for
                                                   ``x != y`` over the seeds (up to ``a_j, a'_j != 0``),
                                                   the pairwise independence the analysis needs
    ``m_j(x) = mix(g_j(x))``                       a fixed 32-bit xorshift-multiply-xorshift bijection: a
                                                   function of ``g_j`` alone keeps that independence, and
                                                   it breaks up the arithmetic progressions ``g_j``
                                                   forms along consecutive coordinates (``g_j mod c`` and
                                                   the low bit of ``g_j`` repeat with short periods for
                                                   some seeds)
    ``h_j(x) = floor(m_j(x) c / 2**32)``           the top bits of ``m_j``
    ``s_j(x) = +1 if m_j(x) is even, else -1``     its lowest bit (the bucket takes the top ones)

All of it is int64 arithmetic whose intermediates stay below ``2**63``, so the hashes are exact
integers, identical on every rank and every device. Memory: ``3 r`` int64 seeds in all, nothing per
coordinate. :meth:`CountSketch.sketch` and :meth:`CountSketch.estimate` hash the coordinates in chunks
of ``CHUNK_CELLS // r``, so their temporaries (a few 8-byte integers per (row, coordinate) pair of a
chunk: some 40 MB, plus the sketched values of a chunk per batch row) stay bounded whatever ``d``.

On fp32 CPU tensors of at most ``2**30`` coordinates (``x_1 = 0``), both run in C instead
(``hsc_sketch``, and ``hsc_estimate`` up to 16 rows, of :mod:`hvd_scalecom.native`): they hash each
coordinate in integer arithmetic, nothing stored, and compute the same floats as the torch
operations, bit for bit: each cell's terms added in the order ``index_add_`` adds them, and the
element ``torch.median`` picks, NaN included (``tests/test_sketch_kernels.py``).
"""

import torch

from hvd_scalecom.sketched_qsparse_config import MAX_SKETCH_COLUMNS
from hvd_scalecom.torch import clt_k

PRIME = 2**31 - 1                     # p of the hash family
LIMB_BITS = 30                        # x = x_0 + 2**30 x_1, both limbs < p
MAX_NUMEL = 2 ** (2 * LIMB_BITS)      # x_1 < 2**30 keeps a' x_1 < 2**61
MAX_COLUMNS = MAX_SKETCH_COLUMNS      # m c < 2**63
CHUNK_CELLS = 1 << 20                 # (row, coordinate) pairs hashed at once
MIX_MULTIPLIER = 0x7FEB352D           # odd and < 2**31 (from Wellons' lowbias32): m * it < 2**63
_MASK32 = 2**32 - 1


def _native_library(*tensors):
    """The C kernels where they apply to ``tensors`` (contiguous fp32 CPU tensors outside autograd),
    else None."""
    return None if any(t.requires_grad for t in tensors) else clt_k.kernels_for(*tensors)


def mix32_(h):
    """In place on int64 ``h`` in ``[0, 2**32)``: ``h ^= h >> 16; h = h * M mod 2**32; h ^= h >> 15``,
    a bijection of ``[0, 2**32)``."""
    h.bitwise_xor_(h >> 16)
    h.mul_(MIX_MULTIPLIER).bitwise_and_(_MASK32)
    return h.bitwise_xor_(h >> 15)


class CountSketch:
    """Hashes of an ``r x c`` count sketch of ``numel``-entry vectors; sketching and estimation.

    Both methods accept leading batch dimensions (e.g. one row per worker). ``device`` says where the
    seeds are placed first; the hashes are computed on the device of the tensor sketched or estimated.
    """

    def __init__(self, numel, rows, columns, seed=0, device=None):
        if rows < 1 or columns < 1:
            raise ValueError(f"a count sketch needs rows >= 1 and columns >= 1, got {rows} x {columns}")
        if columns >= MAX_COLUMNS:
            raise ValueError(f"a count sketch has fewer than 2**31 columns, got {columns}")
        if not 1 <= numel < MAX_NUMEL:
            raise ValueError(f"a count sketch hashes at least 1 and fewer than 2**{2 * LIMB_BITS} coordinates, "
                             f"got {numel}")
        generator = torch.Generator().manual_seed(int(seed))
        self.numel, self.rows, self.columns = int(numel), int(rows), int(columns)
        multipliers = torch.randint(1, PRIME, (rows, 2), generator=generator, dtype=torch.int64)
        offsets = torch.randint(0, PRIME, (rows, 1), generator=generator, dtype=torch.int64)
        self.seeds = torch.cat([multipliers, offsets], dim=1)   # (rows, 3): a_j, a'_j, b_j
        self._placed = {}
        self._seeds_on(torch.device("cpu") if device is None else torch.device(device))
        self.chunk = max(1, CHUNK_CELLS // self.rows)

    def hashes(self, index):
        """``(buckets, signs)`` of the int64 coordinate indices ``index`` (1-D): two ``(rows, len)``
        int64 tensors on ``index``'s device, ``h_j(x)`` in ``[0, columns)`` and ``s_j(x)`` in ``{-1, +1}``."""
        seeds = self._seeds_on(index.device)
        index = index.to(torch.int64)
        low = index & ((1 << LIMB_BITS) - 1)
        g = seeds[:, 0:1] * low                                          # < 2**61
        g += seeds[:, 2:3]
        if self.numel > 1 << LIMB_BITS:                                   # else x_1 = 0 everywhere
            g += seeds[:, 1:2] * (index >> LIMB_BITS)                     # sum < 2**62 + 2**31
        m = mix32_(torch.remainder(g, PRIME, out=g))
        buckets = (m * self.columns).bitwise_right_shift_(32)
        signs = m.bitwise_and_(1).mul_(-2).add_(1)
        return buckets, signs

    def sketch(self, v):
        """``S(v)``: shape ``(..., rows, columns)`` for ``v`` of shape ``(..., numel)``."""
        lead = v.shape[:-1]
        flat = v.reshape(-1, self.numel)
        batch = flat.shape[0]
        table = torch.zeros(batch, self.rows * self.columns, dtype=v.dtype, device=v.device)
        lib = _native_library(flat) if self.numel <= 1 << LIMB_BITS else None
        if lib is not None and lib.hsc_sketch(flat.data_ptr(), batch, self.numel, self.seeds.data_ptr(), self.rows,
                                              self.columns, table.data_ptr()) == 0:
            return table.reshape(*lead, self.rows, self.columns)
        for start, stop, cells, signs in self._chunks(v.device):
            signed = (flat[:, None, start:stop] * signs.to(v.dtype)).reshape(batch, self.rows * (stop - start))
            table.index_add_(1, cells, signed)
        return table.reshape(*lead, self.rows, self.columns)

    def estimate(self, table):
        """Median-of-rows estimate of every entry, ``(..., numel)``, from a ``(..., rows, columns)`` table."""
        lead = table.shape[:-2]
        flat = table.reshape(-1, self.rows * self.columns)
        batch = flat.shape[0]
        out = torch.empty(batch, self.numel, dtype=table.dtype, device=table.device)
        lib = _native_library(flat) if self.numel <= 1 << LIMB_BITS else None
        if lib is not None and lib.hsc_estimate(flat.data_ptr(), batch, self.numel, self.seeds.data_ptr(), self.rows,
                                                self.columns, out.data_ptr()) == 0:  # else more than 16 rows
            return out.reshape(*lead, self.numel)
        for start, stop, cells, signs in self._chunks(table.device):
            per_row = flat[:, cells].reshape(batch, self.rows, stop - start) * signs.to(table.dtype)
            out[:, start:stop] = per_row.median(dim=1).values
        return out.reshape(*lead, self.numel)

    def _chunks(self, device):
        """``(start, stop, cells, signs)`` through the coordinates: ``cells`` the positions of
        ``(row j, h_j(x))`` in the flattened table, row-major over ``(rows, stop - start)``."""
        offsets = torch.arange(self.rows, device=device).unsqueeze(1) * self.columns
        for start in range(0, self.numel, self.chunk):
            stop = min(self.numel, start + self.chunk)
            buckets, signs = self.hashes(torch.arange(start, stop, device=device))
            yield start, stop, buckets.add_(offsets).reshape(-1), signs

    def _seeds_on(self, device):
        key = str(device)
        if key not in self._placed:
            self._placed[key] = self.seeds.to(device)
        return self._placed[key]
