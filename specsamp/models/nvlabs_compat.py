"""A minimal stand-in for NVIDIA's ``torch_utils`` / ``dnnlib`` so EDM pickles can be unpickled.

NVIDIA's checkpoints (EDM, StyleGAN2-ADA, StyleGAN3) are *persistent* pickles: every network object
is stored as ``torch_utils.persistence._reconstruct_persistent_obj(meta)`` where ``meta`` is a dict

    type='class', version=6, module_src=<source of the module defining the class>,
    class_name=<name in that module>, state=<the object's __dict__>

(``torch_utils/persistence.py`` in NVlabs/edm). Unpickling executes ``module_src`` in a fresh module
(which imports ``torch_utils.persistence`` and decorates its classes with ``persistent_class``),
creates the decorated class without calling ``__init__`` and restores ``state``. EDM's network,
loss and augmentation sources also import ``torch_utils.misc`` and may carry ``dnnlib.EasyDict``
values. This module provides exactly that surface, written from the format description, and
:func:`install` registers it in ``sys.modules`` under those names.

**Unpickling runs the code stored in the file.** Callers must verify the file's checksum first
(:func:`specsamp.models.edm.load_edm` does, before anything is unpickled).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import types
import uuid

import numpy as np
import torch

FORMAT_VERSION = 6  # the persistence format version NVIDIA's pickles carry

_PERSISTENT_CLASSES: set[type] = set()
_SOURCE_OF_MODULE: dict[types.ModuleType, str] = {}
_MODULE_OF_SOURCE: dict[str, types.ModuleType] = {}
_IMPORT_HOOKS: list = []


class EasyDict(dict):
    """A dict whose keys are also attributes (``dnnlib.EasyDict``)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value

    def __delattr__(self, name):
        del self[name]


# ----------------------------------------------------------------------------------------------
# torch_utils.persistence


def _source_of(module: types.ModuleType) -> str:
    src = _SOURCE_OF_MODULE.get(module)
    if src is None:
        src = inspect.getsource(module)
        _SOURCE_OF_MODULE[module] = src
        _MODULE_OF_SOURCE[src] = module
    return src


def _module_from_source(src: str) -> types.ModuleType:
    """The module built from ``src``, executing it once per distinct source."""
    module = _MODULE_OF_SOURCE.get(src)
    if module is not None:
        return module
    name = f"_specsamp_persistent_{uuid.uuid4().hex}"
    module = types.ModuleType(name)
    sys.modules[name] = module
    _SOURCE_OF_MODULE[module] = src
    _MODULE_OF_SOURCE[src] = module
    exec(compile(src, f"<persistent module {name}>", "exec"), module.__dict__)  # noqa: S102 - the format's contract
    return module


def is_persistent(obj) -> bool:
    """Whether ``obj`` (a class or an instance) is a persistent class made by :func:`persistent_class`."""
    try:
        if obj in _PERSISTENT_CLASSES:
            return True
    except TypeError:
        pass
    return type(obj) in _PERSISTENT_CLASSES


def persistent_class(orig_class: type) -> type:
    """Class decorator: instances pickle together with the source of the class's module.

    Behaves like ``torch_utils.persistence.persistent_class``: the subclass records the constructor
    arguments (``init_args``, ``init_kwargs``) and reduces to ``_reconstruct_persistent_obj(meta)``.

    Raises:
        TypeError: ``orig_class`` is not a class.
    """
    if not isinstance(orig_class, type):
        raise TypeError(f"persistent_class expects a class, got {type(orig_class).__name__}")
    if is_persistent(orig_class):
        return orig_class
    module = sys.modules[orig_class.__module__]
    src = _source_of(module)

    class Persistent(orig_class):
        _orig_module_src = src
        _orig_class_name = orig_class.__name__

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            record = getattr(self, "_record_init_args", True)
            self._init_args = copy.deepcopy(args) if record else None
            self._init_kwargs = copy.deepcopy(kwargs) if record else None

        @property
        def init_args(self):
            return copy.deepcopy(self._init_args)

        @property
        def init_kwargs(self):
            return EasyDict(copy.deepcopy(self._init_kwargs))

        def __reduce__(self):
            parts = list(super().__reduce__())
            parts += [None] * max(3 - len(parts), 0)
            if parts[0] is not _reconstruct_persistent_obj:
                meta = dict(
                    type="class",
                    version=FORMAT_VERSION,
                    module_src=self._orig_module_src,
                    class_name=self._orig_class_name,
                    state=parts[2],
                )
                parts[0], parts[1], parts[2] = _reconstruct_persistent_obj, (meta,), None
            return tuple(parts)

    Persistent.__name__ = orig_class.__name__
    Persistent.__qualname__ = orig_class.__qualname__
    Persistent.__module__ = orig_class.__module__
    _PERSISTENT_CLASSES.add(Persistent)
    return Persistent


def import_hook(hook):
    """Register ``hook(meta) -> meta`` to patch persistent objects as they are unpickled."""
    if not callable(hook):
        raise TypeError("import_hook expects a callable hook(meta) -> meta")
    _IMPORT_HOOKS.append(hook)
    return hook


def _reconstruct_persistent_obj(meta):
    """Unpickling entry point of persistent objects (name fixed by the format)."""
    meta = EasyDict(meta)
    meta.state = EasyDict(meta.state or {})
    for hook in _IMPORT_HOOKS:
        meta = hook(meta)
    if meta.version != FORMAT_VERSION or meta.type != "class":
        raise ValueError(
            f"unsupported persistent object (type={meta.get('type')!r}, version={meta.get('version')!r}); "
            f"this loader reads type='class', version={FORMAT_VERSION}"
        )
    module = _module_from_source(meta.module_src)
    cls = persistent_class(module.__dict__[meta.class_name])
    obj = cls.__new__(cls)
    setstate = getattr(obj, "__setstate__", None)
    if callable(setstate):
        setstate(meta.state)
    else:
        obj.__dict__.update(meta.state)
    return obj


# ----------------------------------------------------------------------------------------------
# torch_utils.misc: the helpers EDM's module sources reference


def constant(value, shape=None, dtype=None, device=None, memory_format=None) -> torch.Tensor:
    """``torch_utils.misc.constant``: a (broadcast) constant tensor (uncached here)."""
    value = np.asarray(value)
    if shape is not None:
        shape = tuple(shape)
    if dtype is None:
        dtype = torch.get_default_dtype()
    if device is None:
        device = torch.device("cpu")
    if memory_format is None:
        memory_format = torch.contiguous_format
    t = torch.as_tensor(value.copy(), dtype=dtype, device=device)
    if shape is not None:
        t, _ = torch.broadcast_tensors(t, torch.empty(shape))
    return t.contiguous(memory_format=memory_format)


def const_like(ref: torch.Tensor, value, shape=None, dtype=None, device=None) -> torch.Tensor:
    """``torch_utils.misc.const_like``."""
    return constant(value, shape=shape, dtype=dtype or ref.dtype, device=device or ref.device)


def assert_shape(tensor: torch.Tensor, ref_shape) -> None:
    """``torch_utils.misc.assert_shape``: ``None`` entries match any size.

    Raises:
        AssertionError: rank or a fixed size differs.
    """
    if tensor.ndim != len(ref_shape):
        raise AssertionError(f"wrong number of dimensions: got {tensor.ndim}, expected {len(ref_shape)}")
    for i, (size, ref) in enumerate(zip(tensor.shape, ref_shape)):
        if ref is not None and int(size) != int(ref):
            raise AssertionError(f"wrong size for dimension {i}: got {size}, expected {ref}")


# ----------------------------------------------------------------------------------------------
# module objects and registration

MODULE_NAMES = ("dnnlib", "dnnlib.util", "torch_utils", "torch_utils.persistence", "torch_utils.misc")


def _build_modules() -> dict[str, types.ModuleType]:
    util = types.ModuleType("dnnlib.util", "specsamp stand-in for dnnlib.util")
    util.EasyDict = EasyDict
    dnnlib = types.ModuleType("dnnlib", "specsamp stand-in for dnnlib")
    dnnlib.EasyDict = EasyDict
    dnnlib.util = util
    dnnlib.__path__ = []  # a package, so `import dnnlib.util` works

    persistence = types.ModuleType("torch_utils.persistence", "specsamp stand-in for torch_utils.persistence")
    for name in ("persistent_class", "is_persistent", "import_hook", "_reconstruct_persistent_obj"):
        setattr(persistence, name, globals()[name])
    _reconstruct_persistent_obj.__module__ = "torch_utils.persistence"
    misc = types.ModuleType("torch_utils.misc", "specsamp stand-in for torch_utils.misc")
    misc.constant, misc.const_like, misc.assert_shape = constant, const_like, assert_shape
    misc.EasyDict = EasyDict
    torch_utils = types.ModuleType("torch_utils", "specsamp stand-in for torch_utils")
    torch_utils.persistence, torch_utils.misc = persistence, misc
    torch_utils.__path__ = []
    return {
        "dnnlib": dnnlib,
        "dnnlib.util": util,
        "torch_utils": torch_utils,
        "torch_utils.persistence": persistence,
        "torch_utils.misc": misc,
    }


_MODULES = _build_modules()


def modules() -> dict[str, types.ModuleType]:
    """The stand-in modules by their NVIDIA names (``dnnlib``, ``torch_utils.persistence``, ...)."""
    return dict(_MODULES)


@contextlib.contextmanager
def installed():
    """Register the stand-ins in ``sys.modules`` for the duration of an unpickling.

    Names that another package already registered (e.g. a real NVlabs checkout on ``sys.path``) are
    shadowed only inside the block and restored after it; names that were free keep the stand-ins
    afterwards, so loaded networks can still be pickled or deep-copied.
    """
    previous = {name: sys.modules.get(name) for name in MODULE_NAMES}
    sys.modules.update(_MODULES)
    try:
        yield _MODULES
    finally:
        for name, mod in previous.items():
            if mod is not None:
                sys.modules[name] = mod


def install() -> None:
    """Register the stand-ins in ``sys.modules`` where those names are free."""
    for name, mod in _MODULES.items():
        sys.modules.setdefault(name, mod)
