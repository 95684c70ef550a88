"""hpc_submitit: hpc-ddp's submitit plugin (PBS Pro executor and job environment).

It lives outside the ``hpc`` package on purpose: its classes subclass submitit's,
so importing it imports submitit, while ``hpc`` itself must never do that at import
time. submitit finds it through the ``submitit`` entry points in setup.cfg;
``hpc.executor(cluster="aurora", ...)`` imports it only when called.
"""
