"""A keyed permutation of [0, n) in O(1) memory, for any n up to 2^62.

A balanced Feistel network (Luby & Rackoff 1988) is a bijection on b-bit integers whatever its
round function; here b is the smallest even bit count with 2^b >= n, each round function is
SplitMix64 of (round key, half), and indices that land in [n, 2^b) are sent through the network
again until they land in [0, n) ("cycle walking", Black & Rogaway 2002): the result is a bijection
on [0, n) itself, and since 2^b < 4n the expected number of walks is below 4. The inverse runs the
rounds backwards (tests use it to check the bijection where n is too large to enumerate).

Sample i of an epoch is `window[perm(i)]`: nothing of size n is ever built (a numpy permutation of
15T tokens' windows at seq 8192 would be 1.8 G x 8 bytes = 15 GB on every rank and loader worker).
"""
from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1
_ROUNDS = 6


def _mix(z: int) -> int:
    """SplitMix64's finaliser (Steele et al. 2014): 64 well-mixed bits from 64."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class Permutation:
    """perm(i) for i in [0, n): a bijection keyed by `key` (any int)."""

    def __init__(self, n: int, key: int):
        if n < 1 or n > 1 << 62:
            raise ValueError(f"Permutation: n = {n} must be in [1, 2^62]")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2^(2 half) >= n
        self.mask = (1 << self.half) - 1
        k = _mix(key & _M64)
        self.keys = []
        for _ in range(_ROUNDS):
            k = _mix(k)
            self.keys.append(k)

    def _round(self, r: int, x: int) -> int:
        return _mix(x ^ self.keys[r]) & self.mask

    def _forward(self, x: int) -> int:
        lo, hi = x & self.mask, x >> self.half
        for r in range(_ROUNDS):
            lo, hi = hi ^ self._round(r, lo), lo
        return (hi << self.half) | lo

    def _backward(self, x: int) -> int:
        lo, hi = x & self.mask, x >> self.half
        for r in reversed(range(_ROUNDS)):
            lo, hi = hi, lo ^ self._round(r, hi)
        return (hi << self.half) | lo

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} outside [0, {self.n})")
        x = self._forward(i)
        while x >= self.n:  # cycle walking
            x = self._forward(x)
        return x

    def inverse(self, j: int) -> int:
        if not 0 <= j < self.n:
            raise IndexError(f"{j} outside [0, {self.n})")
        x = self._backward(j)
        while x >= self.n:
            x = self._backward(x)
        return x

    def many(self, idx: np.ndarray) -> np.ndarray:
        """perm over an array of indices (uint64 arithmetic, for checks over whole ranges)."""
        x = self._forward_np(np.asarray(idx, dtype=np.uint64))
        out = np.array(x)
        walk = out >= self.n
        while walk.any():
            out[walk] = self._forward_np(out[walk])
            walk = out >= self.n
        return out

    def _forward_np(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self.half), np.uint64(self.mask)
        lo, hi = x & mask, x >> half
        for r in range(_ROUNDS):
            lo, hi = hi ^ (_mix_np(lo ^ np.uint64(self.keys[r])) & mask), lo
        return (hi << half) | lo


def _mix_np(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as SplitMix64 intends
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def epoch_key(seed: int, epoch: int) -> int:
    """The permutation key of (data seed, epoch)."""
    return _mix((seed * 0x2545F4914F6CDD1D + epoch) & _M64)
