"""Horovod's API over commlib: ``import commlib.horovod.torch as hvd`` where a script had
``import horovod.torch as hvd``.

Only :mod:`commlib.horovod.torch` exists (PyTorch); see the README's "Coming from
Horovod" for what maps to what and what is not supported.

Example:
    >>> import commlib.horovod.torch as hvd
    >>> hvd.init()
    >>> hvd.allreduce(torch.ones(3), op=hvd.Sum)      # tensor([2., 2., 2.]) on 2 ranks
"""

# bindings/ is also installed as commlib.bindings: importing these files under that second
# name would make a second engine, a second handle table and a second set of classes.
if __name__ != "commlib.horovod":
    raise ImportError(
        f"this package is commlib.horovod (imported here as {__name__!r}); "
        "use `import commlib.horovod.torch as hvd`")
