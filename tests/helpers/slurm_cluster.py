"""A real single-node Slurm for the tests: its own munged, slurmctld and slurmd (Debian's `munge` and
`slurm-wlm`, run as root), configured in a temporary directory on free ports, with two GPUs stood in
by empty files (`gres/gpu` needs files; no CUDA is touched). `SlurmCluster.env` holds SLURM_CONF for
the client commands (sbatch, squeue, scancel)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.processes import free_port, stop_all, wait_until

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "scontrol")
GPUS = 2


def unavailable() -> str | None:
    """Why a Slurm cannot be started here (None: it can)."""
    if os.geteuid() != 0:
        return "the Slurm test starts slurmd and munged as root; not root here"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"no {', '.join(missing)} here (Debian: apt-get install slurm-wlm munge; .ci/run does)"
    return None


@dataclass
class SlurmCluster:
    directory: Path
    env: dict[str, str]
    processes: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *command: str) -> str:
        return run_with(self.env, *command)

    def job_gone(self, job: str) -> bool:
        result = subprocess.run(["squeue", "-h", "-j", job], env=self.env, capture_output=True, text=True, timeout=60)
        return not result.stdout.strip()

    def stop(self) -> None:
        stop_all(self.processes, timeout=20)


def run_with(env: dict[str, str], *command: str) -> str:
    """A Slurm client command's output; an assertion naming it and its stderr when it fails."""
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(command)}: {result.stderr}"
    return result.stdout


def start(directory: Path) -> SlurmCluster:
    """munged, slurmctld and slurmd up, the node idle."""
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "munge"):
        (directory / sub).mkdir(parents=True)
    (directory / "munge").chmod(0o755)
    key = directory / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    conf = directory / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=pipelinetest", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={directory}/munge/sock",
        f"StateSaveLocation={directory}/state", f"SlurmdSpoolDir={directory}/spool",
        f"SlurmctldPidFile={directory}/slurmctld.pid", f"SlurmdPidFile={directory}/slurmd.pid",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        f"SlurmctldLogFile={directory}/slurmctld.log", f"SlurmdLogFile={directory}/slurmd.log",
        # No cgroups in a container: processes are tracked by parentage, as the launcher must not
        # leave any that escape it.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "GresTypes=gpu", "ReturnToService=2",
        "KillWait=10", "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        f"NodeName={host} CPUs={os.cpu_count()} Gres=gpu:{GPUS} State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""]))
    for gpu in range(GPUS):
        (directory / f"gpu{gpu}").touch()
    (directory / "gres.conf").write_text(f"NodeName={host} Name=gpu File={directory}/gpu[0-{GPUS - 1}]\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(directory, env)
    log = (directory / "daemons.log").open("w")
    munge = ["munged", "-F", "-f", "-S", f"{directory}/munge/sock", f"--key-file={key}",
             f"--log-file={directory}/munged.log", f"--pid-file={directory}/munged.pid",
             f"--seed-file={directory}/munged.seed"]
    cluster.processes.append(subprocess.Popen(munge, stdout=log, stderr=subprocess.STDOUT))
    wait_until(lambda: (directory / "munge" / "sock").exists(), 30, "munged's socket")
    for daemon in ("slurmctld", "slurmd"):
        cluster.processes.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=log,
                                                  stderr=subprocess.STDOUT))
    try:
        wait_until(lambda: _node_state(cluster) == "idle", 60, "the Slurm node to be idle")
    except AssertionError:
        cluster.stop()
        raise
    return cluster


def _node_state(cluster: SlurmCluster) -> str:
    result = subprocess.run(["sinfo", "-h", "-o", "%t"], env=cluster.env, capture_output=True, text=True, timeout=30)
    return result.stdout.strip()
