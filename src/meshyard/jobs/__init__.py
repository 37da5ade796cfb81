"""Job descriptions for schedulers: sbatch scripts (``slurm``) and Kubernetes training
(``kubernetes``) and serving (``serve_manifest``) manifests, with their commands
(``meshyard slurm``, ``meshyard k8s``). Nothing here starts a process: the scripts and
manifests run ``meshyard run``, which ``meshyard.launch`` starts."""
