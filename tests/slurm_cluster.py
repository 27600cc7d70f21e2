"""A real, throw-away Slurm cluster for tests: munged, slurmctld and two slurmd daemons on localhost.

Everything (munge key and socket, slurm.conf, state, spool, logs) lives in one temporary directory;
nothing in /etc is read or written. Clients find the cluster through `SLURM_CONF`, which
`SlurmCluster.env()` sets. Both nodes are emulated slurmd processes on 127.0.0.1 (`slurmd -N`),
so a 2-node job is two "machines" sharing this host's cores and filesystem.

Needs Debian's `slurm-wlm` and `munge` packages (slurmctld, slurmd, client tools, munged, mungekey)
and root (SlurmUser=root, as in a CI container).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scontrol",
                     "srun", "scancel")
NODES = ("n1", "n2")
PARTITION = "debug"


def missing_requirements() -> str | None:
    """Why the cluster cannot start here (for pytest.skip), or None."""
    absent = [name for name in REQUIRED_BINARIES
              if not (shutil.which(name) or Path("/usr/sbin", name).exists())]
    if absent:
        return (f"Slurm test cluster needs {', '.join(absent)}: "
                "apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        return "Slurm test cluster runs its daemons as SlurmUser=root: run the tests as root"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(count: int) -> list[int]:
    # hold every socket open until all are chosen so the kernel cannot hand out one port twice
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def slurm_conf_text(root: Path, *, ctld_port: int, node_ports: dict[str, int], munge_socket: Path) -> str:
    node_lines = "\n".join(
        f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname=localhost Port={port} CPUs=2 "
        "Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=1024 State=UNKNOWN"
        for name, port in node_ports.items())
    return f"""\
ClusterName=jobspectest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=5
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=30
MinJobAge=600
{node_lines}
PartitionName={PARTITION} Nodes={",".join(node_ports)} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    conf: Path = field(init=False)
    processes: list = field(default_factory=list)

    def __post_init__(self):
        self.conf = self.root / "slurm.conf"

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run([_binary(argv[0]), *argv[1:]], env=self.env(), capture_output=True, text=True,
                              check=check, timeout=timeout)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> SlurmCluster:
        for sub in ("munge", "state", "spool", "log", *(f"spool/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge_dir = self.root / "munge"
        munge_dir.chmod(0o700)
        key = munge_dir / "munge.key"
        subprocess.run([_binary("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        key.chmod(0o600)
        socket_path = munge_dir / "munge.socket"
        self._spawn("munged", [_binary("munged"), "--foreground", "--force", f"--socket={socket_path}",
                               f"--key-file={key}", f"--pid-file={munge_dir / 'munged.pid'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--seed-file={munge_dir / 'munged.seed'}"])
        self._wait(lambda: socket_path.exists(), timeout, "munged did not create its socket")

        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        self.conf.write_text(slurm_conf_text(self.root, ctld_port=ctld_port,
                                             node_ports=dict(zip(NODES, node_ports)), munge_socket=socket_path))
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", [_binary("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._all_idle, timeout, "the nodes did not become idle")
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.root / "log" / f"{name}.stdout", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append((name, proc))

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [name for name, proc in self.processes if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during start-up\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} within {timeout:.0f} s\n{self.logs()}")

    def _all_idle(self) -> bool:
        result = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False)
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return result.returncode == 0 and all(states.get(n) == "idle" for n in NODES)

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons: slurmd/slurmctld before munged (they need it to exit)."""
        if self.conf.exists():
            self.run("scancel", "--full", "--partition", PARTITION, check=False)
        for name, proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)
        self.processes.clear()

    def logs(self, tail_lines: int = 15) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-tail_lines:]
            out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)

    # --- jobs ---------------------------------------------------------------------------------

    def job_state(self, job_id: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, ...) from slurmctld's memory (no accounting here)."""
        result = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False)
        for item in result.stdout.split():
            if item.startswith("JobState="):
                return item.split("=", 1)[1]
        return "UNKNOWN"

    def job_field(self, job_id: str, name: str) -> str | None:
        result = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False)
        for item in result.stdout.split():
            if item.startswith(f"{name}="):
                return item.split("=", 1)[1]
        return None

    def wait_for_state(self, job_id: str, states: set[str], timeout: float, poll_s: float = 1.0) -> str:
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(poll_s)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s (wanted {sorted(states)})\n"
                           f"{self.run('scontrol', 'show', 'job', job_id, check=False).stdout}\n{self.logs()}")


def start_cluster(root: Path) -> SlurmCluster:
    cluster = SlurmCluster(Path(root))
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise
