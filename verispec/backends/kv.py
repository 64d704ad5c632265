"""Key/value caches: ``KVBuffer`` (keys and values in buffers with spare room), the ``transformers`` cache whose
layers are such buffers (``new_cache``), and one sequence's cache bookkeeping (``KVState``).

``committed`` entries belong to the committed text; a forward appends ``pending`` entries (tree nodes); a commit
turns the pending entries it keeps into committed ones, in order, and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import VerispecError


@dataclass
class KVState:
    """One sequence's KV cache and its bookkeeping (see the module docstring)."""

    cache: object
    committed: int = 0
    pending_positions: list[int] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return len(self.pending_positions)


BLOCK = 64  # a buffer holds whole blocks of entries: the lean forward's invariant attention reads whole blocks


def whole_blocks(n: int) -> int:
    """``n`` entries rounded up to whole ``BLOCK``s."""
    return -(-n // BLOCK) * BLOCK


class KVBuffer:
    """Keys and values along axis -2 in buffers with spare room: appending copies only the new entries, keeping a
    prefix copies nothing. The layer of ``new_cache``'s cache and of the lean forward's (``backends/lean.py``)."""

    _kbuf = _vbuf = None
    _len = 0
    fixed = False  # buffers given from outside (a slot of a batch's pool): never reallocated

    @classmethod
    def in_place(cls, kbuf: torch.Tensor, vbuf: torch.Tensor) -> "KVBuffer":
        """A buffer that lives in the given tensors (``[..., capacity, head dim]``); appending past their capacity is
        an error rather than a reallocation."""
        out = cls()
        out._kbuf, out._vbuf, out.fixed = kbuf, vbuf, True
        out._set_length(0)
        return out

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new entries; returns all keys and values so far (views of the buffers)."""
        need = self.room(key_states, value_states.shape[-1])
        self._kbuf[..., self._len:need, :] = key_states
        self._vbuf[..., self._len:need, :] = value_states
        self._set_length(need)
        return self.keys, self.values

    def room(self, key_states: torch.Tensor, value_dim: int) -> int:
        """Make the buffers hold the entries so far and ``key_states``' (``[..., n, head dim]``; their values have
        ``value_dim``), reallocating as ``append`` does, without writing them; returns that length (the caller writes
        the entries and sets it)."""
        need = self._len + key_states.shape[-2]
        if self.fixed and need > self._kbuf.shape[-2]:
            raise VerispecError(f"this sequence's cache holds {self._kbuf.shape[-2]} entries and needs {need}: "
                                "its batch was sized for shorter sequences")
        if self._kbuf is None or need > self._kbuf.shape[-2]:
            cap = whole_blocks(max(need + 64, 2 * (0 if self._kbuf is None else self._kbuf.shape[-2])))
            # the spare entries are zeros (finite): the lean forward's attention reads them as masked padding
            kbuf = key_states.new_zeros(*key_states.shape[:-2], cap, key_states.shape[-1])
            vbuf = key_states.new_zeros(*key_states.shape[:-2], cap, value_dim)
            if self._len:
                kbuf[..., : self._len, :] = self._kbuf[..., : self._len, :]
                vbuf[..., : self._len, :] = self._vbuf[..., : self._len, :]
            self._kbuf, self._vbuf = kbuf, vbuf
        return need

    @property
    def keys(self) -> torch.Tensor | None:
        """The entries so far (a view of the buffer), made when read: the lean forward sets a length once per layer
        and sequence each step and reads the buffer itself."""
        return None if self._kbuf is None else self._kbuf[..., : self._len, :]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._vbuf is None else self._vbuf[..., : self._len, :]

    def _set_length(self, n: int) -> None:
        self._len = n

    def keep(self, n: int) -> None:
        """Keep the first ``n`` entries (copies nothing)."""
        if self._kbuf is not None:
            self._set_length(min(n, self._len))

    def keep_after(self, first: int, moved: torch.Tensor) -> None:
        """Keep the first ``first`` entries where they are and the entries ``moved`` after them, in this order: a
        verdict's path after the committed text copies its own entries only, not the text's."""
        if self._kbuf is None:
            return
        n = first + len(moved)
        if len(moved):
            with torch.inference_mode(self._kbuf.is_inference()):  # buffers made by a forward under inference mode
                k, v = self._kbuf.index_select(-2, moved), self._vbuf.index_select(-2, moved)
                self._kbuf[..., first:n, :] = k
                self._vbuf[..., first:n, :] = v
        self._set_length(n)


class _BufferLayer(KVBuffer):
    """Mixed into ``DynamicLayer`` (which concatenates, copying the whole cache at every forward): its entries live
    in a ``KVBuffer``."""

    keys = values = None  # attributes, not the views made when read: ``DynamicLayer`` assigns them

    def _set_length(self, n: int) -> None:
        self._len = n
        self.keys, self.values = self._kbuf[..., :n, :], self._vbuf[..., :n, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._kbuf = self._vbuf = None
            self._len = 0
        return self.append(key_states, value_states)


def new_cache():
    """An empty KV cache of buffered layers (no config: every layer keeps every entry; sliding windows are applied
    by the masks ``CausalLM.forward`` builds)."""
    from transformers import DynamicCache  # noqa: PLC0415 - a 0.7 s import, needed here only
    from transformers.cache_utils import DynamicLayer  # noqa: PLC0415 - a 0.7 s import, needed here only

    global _BUFFERED
    if _BUFFERED is None:
        _BUFFERED = type("BufferedLayer", (_BufferLayer, DynamicLayer), {})
    cache = DynamicCache()
    cache.layer_class_to_replicate = _BUFFERED
    return cache


_BUFFERED = None
