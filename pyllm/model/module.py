"""The model's building block: an nn.Module whose call is its forward and whose
submodules, parameters and buffers are plain attributes.

A decode step of a 30-layer model makes about 270 module calls, 300 submodule lookups
and 180 weight lookups. nn.Module's __call__ (hooks, tracing checks) and its
__getattr__ (a walk of the _parameters, _buffers and _modules dicts, taken for every
submodule, parameter and buffer since they are never in the instance __dict__) cost
about 0.5-1 ms of a 9 ms SmolLM2 step on 2 cores. pyllm's models use no hooks, so a
call goes straight to forward, and each submodule, parameter and buffer is also kept
in the instance __dict__ where normal attribute lookup finds it first. nn.Module's own
bookkeeping (state_dict, named_modules, ...) is unchanged; what replaces entries of
its dicts behind __setattr__'s back (register_*, _apply) refreshes the copies.
"""

from __future__ import annotations

from torch import nn


class Module(nn.Module):
    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.__call__ = cls.forward

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)  # an entry of nn.Module's dicts leaves __dict__
        self._mirror(name)

    def __delattr__(self, name: str) -> None:
        if name in self._modules or name in self._parameters or name in self._buffers:
            self.__dict__.pop(name, None)
        super().__delattr__(name)

    def register_parameter(self, name: str, param) -> None:
        super().register_parameter(name, param)
        self._mirror(name)

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        super().register_buffer(name, tensor, persistent)
        self._mirror(name)

    def _apply(self, fn, recurse=True):
        # .to(), .float(), ... may put new tensors in _parameters and _buffers.
        out = super()._apply(fn, recurse)
        for name in (*self._parameters, *self._buffers):
            self._mirror(name)
        return out

    def _mirror(self, name: str) -> None:
        """Copies nn.Module's entry for name, if it has one, into the instance __dict__."""
        d = self.__dict__
        for table in ("_modules", "_parameters", "_buffers"):
            entries = d.get(table)
            if entries is not None and name in entries:
                d[name] = entries[name]
                return
