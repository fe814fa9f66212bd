"""Past one node, through what clusters already run: ``export`` (Prometheus text per node, or
node_exporter's textfile collector) and ``relay`` (gpumon's protocol over stdin/stdout, the
node end of ``gpumon attach --hosts`` / ``--slurm``). Both are front ends of a client target
(gpumon/client); the fan-in side is ``gpumon.client.remote``."""
