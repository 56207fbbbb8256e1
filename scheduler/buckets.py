"""Fixed shape buckets for the jitted step: one compiled program per (T, S, W), and per (T, S, W) of the decode
token buckets a second one for decode-only steps."""

from __future__ import annotations

import bisect
import dataclasses


def geometric_ladder(low: int, high: int, ratio: int = 2) -> tuple[int, ...]:
    """``low, low*ratio, low*ratio**2, ...`` below ``high``, then ``high``; ValueError if ``low < 1`` or ``ratio < 2``."""
    if low < 1 or ratio < 2:
        raise ValueError(f"geometric_ladder: low={low} must be >= 1 and ratio={ratio} >= 2")
    values = []
    v = low
    while v < high:
        values.append(v)
        v *= ratio
    values.append(high)
    return tuple(values)


def half_step_ladder(low: int, high: int) -> tuple[int, ...]:
    """``low, 1.5 low, 2 low, 3 low, 4 low, 6 low, ...`` below ``high``, then ``high`` (padding under a third of a
    step); ValueError if ``low < 2`` or odd."""
    if low < 2 or low % 2:
        raise ValueError(f"half_step_ladder: low={low} must be an even number >= 2")
    values = sorted(set(geometric_ladder(low, high)[:-1]) | set(v * 3 // 2 for v in geometric_ladder(low, high)[:-1]))
    return tuple(v for v in values if v < high) + (high,)


def _ladder(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from ``low`` (rounded up to one) below ``high``, then ``high`` itself."""
    return geometric_ladder(1 << max(low - 1, 0).bit_length(), high)


@dataclasses.dataclass(frozen=True)
class BucketTable:
    """The padded sizes a batch may take: tokens T, rows S, block-table width W (vLLM's CUDA-graph sizes, all three).

    Each ladder strictly increases to its maximum. Each T pairs with one S (:meth:`seq_bucket_for`); batches pad to
    :meth:`pick`. A step whose every row has one new token (decode-only) runs its own program where T is one of
    ``decode_token_buckets`` (vLLM's uniform-decode CUDA graphs), so attention needs no branch on the batch; the
    programs are :meth:`all_programs`, ``(len(token_buckets) + len(decode_token_buckets)) * len(width_buckets)``.

    Attributes: token_buckets (T), seq_buckets (S; max S <= max T), width_buckets (W), decode_token_buckets (T
    buckets with a decode-only program; empty: none, :meth:`with_decode_programs` fills it). Raises ValueError for
    an empty ladder, a value < 1, a ladder not strictly increasing, max S > max T, or a decode token bucket that is
    no token bucket.
    """

    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    width_buckets: tuple[int, ...]
    decode_token_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("token_buckets", "seq_buckets", "width_buckets"):
            ladder = tuple(int(v) for v in getattr(self, name))
            if not ladder or ladder[0] < 1 or any(a >= b for a, b in zip(ladder, ladder[1:])):
                raise ValueError(f"BucketTable.{name}={ladder} must be non-empty, >= 1 and strictly increasing")
            object.__setattr__(self, name, ladder)
        if self.seq_buckets[-1] > self.token_buckets[-1]:
            raise ValueError(
                f"BucketTable: largest seq bucket {self.seq_buckets[-1]} exceeds largest token bucket "
                f"{self.token_buckets[-1]}; a row has at least one token"
            )
        decode = tuple(int(v) for v in self.decode_token_buckets)
        if not set(decode) <= set(self.token_buckets) or list(decode) != sorted(set(decode)):
            raise ValueError(f"BucketTable.decode_token_buckets={decode} must be increasing token buckets "
                             f"of {self.token_buckets}")
        object.__setattr__(self, "decode_token_buckets", decode)

    @classmethod
    def from_limits(
        cls,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        *,
        min_tokens: int = 8,
        min_seqs: int = 8,
        min_width: int = 4,
    ) -> "BucketTable":
        """Power-of-two ladders from ``min_tokens`` capped at ``max_num_batched_tokens`` (T), ``max_num_seqs`` (S),
        ``ceil(max_model_len / block_size)`` (W). ValueError if a limit < 1 or ``max_num_seqs > max_num_batched_tokens``."""
        for name, value in (
            ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len), ("block_size", block_size),
            ("min_tokens", min_tokens), ("min_seqs", min_seqs), ("min_width", min_width),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BucketTable.from_limits: {name}={value!r} must be an int >= 1")
        max_width = -(-max_model_len // block_size)
        return cls(
            _ladder(min_tokens, max_num_batched_tokens),
            _ladder(min_seqs, max_num_seqs),
            _ladder(min_width, max_width),
        )

    def seq_bucket_for(self, num_tokens_bucket: int) -> int:
        """The smallest S bucket holding ``min(T, max S)`` rows for T bucket ``num_tokens_bucket``."""
        return _smallest_at_least(self.seq_buckets, min(num_tokens_bucket, self.seq_buckets[-1]), "num_seqs")

    def pick(self, num_tokens: int, num_seqs: int, width: int) -> tuple[int, int, int]:
        """The smallest (T, S, W) of :meth:`all_shapes` holding the batch; ValueError naming a value past its maximum."""
        _smallest_at_least(self.seq_buckets, num_seqs, "num_seqs")
        _smallest_at_least(self.token_buckets, num_tokens, "num_tokens")
        t = next(t for t in self.token_buckets if t >= num_tokens and self.seq_bucket_for(t) >= num_seqs)
        w = _smallest_at_least(self.width_buckets, width, "width")
        return t, self.seq_bucket_for(t), w

    def all_shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, W) that :meth:`pick` can return, T-major."""
        return [(t, self.seq_bucket_for(t), w) for t in self.token_buckets for w in self.width_buckets]

    def with_decode_programs(self) -> "BucketTable":
        """This table with a decode-only program for every T a decode-only step can pad to: a step of n <= max S
        rows has n tokens and pads to the smallest T >= n, so the T buckets below max S and the first at or above it.
        """
        below = [t for t in self.token_buckets if t < self.seq_buckets[-1]]
        first = next(t for t in self.token_buckets if t >= self.seq_buckets[-1])
        return dataclasses.replace(self, decode_token_buckets=tuple(below) + (first,))

    def program_for(self, shape: tuple[int, int, int], decode_only: bool) -> tuple[int, int, int, bool]:
        """The program ``(T, S, W, decode_only)`` of a batch padded to ``shape``: ``decode_only`` (every row has one
        new token) is kept only where T has a decode-only program."""
        return shape + (bool(decode_only) and shape[0] in self.decode_token_buckets,)

    def all_programs(self) -> list[tuple[int, int, int, bool]]:
        """Every step program ``(T, S, W, decode_only)``, T-major, a T's mixed programs before its decode-only ones."""
        return [shape + (decode,) for t in self.token_buckets
                for decode in ((False, True) if t in self.decode_token_buckets else (False,))
                for shape in self.all_shapes() if shape[0] == t]

    def restricted(self, token_buckets: tuple[int, ...]) -> "BucketTable":
        """This table cut to ``token_buckets`` (some of its own, increasing), decode-only programs kept where left."""
        return dataclasses.replace(self, token_buckets=token_buckets,
                                   decode_token_buckets=tuple(t for t in self.decode_token_buckets
                                                              if t in token_buckets))

    def __len__(self) -> int:
        """Number of step programs the runner compiles."""
        return len(self.all_programs())


def _smallest_at_least(ladder: tuple[int, ...], value: int, name: str) -> int:
    i = bisect.bisect_left(ladder, value)
    if i == len(ladder):
        raise ValueError(f"BucketTable.pick: {name}={value} exceeds the largest bucket {ladder[-1]}")
    return ladder[i]
