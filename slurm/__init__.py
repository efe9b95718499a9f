"""Slurm launch for v4launch: submitit executors, sbatch rendering, rendezvous env, requeue/preemption.

Modules: ``params`` (the resource-mapping table and value checks), ``render`` (the exact sbatch
script and the submitit executor), ``rendezvous`` (RANK/WORLD_SIZE/MASTER_ADDR of a task),
``job`` (the Checkpointable each rank runs), ``states`` (the requeue state machine), ``ledger``
(run_dir/ledger.jsonl), ``query`` (squeue/sacct/scontrol/scancel), ``submit`` (run creation and
submission) and ``launcher`` (``SlurmLauncher``: launch, status, cancel, logs). sbatch flags and
SLURM_* variables appear only in this package.
"""
