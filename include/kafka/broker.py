"""A real Kafka broker without Docker: one KRaft node (broker and controller roles in one JVM) on
127.0.0.1, from Maven Central jars, the classes Kafka's shell scripts call.

1. ``fetch_jars`` copies ``kafka_2.13`` and its dependencies (``include/kafka/pom.xml``) into
   ``var/jars/kafka-broker`` with Maven, once.
2. ``start`` writes ``server.properties`` into a data folder, formats it
   (``kafka.tools.StorageTool format --standalone``) and starts ``kafka.Kafka``; it returns once
   the broker answers a metadata request. Besides its PLAINTEXT listener it can open, in the same
   JVM, a SASL_PLAINTEXT listener (mechanism PLAIN, ``sasl_users``) and an SSL listener
   (``tls``: a CA and the broker's keystore from ``make_tls``, self-signed with ``openssl``).

``python -m include.kafka.broker`` (``make kafka``) runs one in the foreground on
127.0.0.1:9092 with its data under ``var/kafka``; the tests start their own on free ports.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from sluice.net import free_port
from sluice.paths import data_dir, jars_dir, project_root

POM = project_root() / "include" / "kafka" / "pom.xml"
#: A short-lived single-node broker: a small heap, the C1 compiler and the serial collector.
JAVA_OPTIONS = ["-Xmx512m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Djava.awt.headless=true"]

LOG4J2 = """\
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka.server.KafkaRaftServer
logger.kafka.level = INFO
"""


def lib_dir() -> Path:
    return jars_dir() / "kafka-broker"


def fetch_jars() -> Path:
    """The broker's jars, fetched with Maven into ``var/jars/kafka-broker`` on first use."""
    lib = lib_dir()
    if lib.is_dir() and any(lib.glob("kafka_2.13-*.jar")):
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError("Maven (mvn) is needed once to fetch the Kafka broker's jars from Maven Central")
    partial = lib.with_name(lib.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    done = subprocess.run([mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
                           f"-DoutputDirectory={partial}", "-DincludeScope=runtime"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"fetching the Kafka broker's jars failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    partial.rename(lib)  # whole or not at all: a broken fetch is retried, never half-used
    return lib


@dataclass(frozen=True)
class Tls:
    """A test CA (``ca_pem``, PEM: what clients trust) and the broker's PKCS12 keystore, its
    certificate signed by that CA for 127.0.0.1 and localhost."""

    ca_pem: Path
    keystore: Path
    password: str


def make_tls(folder: Path, days: int = 2) -> Tls:
    """A throw-away CA and a broker certificate for 127.0.0.1/localhost under ``folder``, with
    ``openssl`` (~0.3 s; keytool would start a JVM per step)."""
    folder.mkdir(parents=True, exist_ok=True)
    password = uuid.uuid4().hex
    ca_key, ca_pem = folder / "ca.key", folder / "ca.pem"
    key, csr, cert = folder / "broker.key", folder / "broker.csr", folder / "broker.pem"
    ext = folder / "broker.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    keystore = folder / "broker.p12"
    for cmd in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca_pem, "-days", days,
         "-subj", "/CN=sluice test CA", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", csr, "-CA", ca_pem, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", days, "-extfile", ext],
        ["pkcs12", "-export", "-in", cert, "-inkey", key, "-certfile", ca_pem, "-name", "broker", "-out", keystore,
         "-passout", f"pass:{password}"],
    ):
        done = subprocess.run(["openssl", *map(str, cmd)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"openssl {cmd[0]} failed:\n{done.stderr[-2000:]}")
    return Tls(ca_pem=ca_pem, keystore=keystore, password=password)


@dataclass
class Broker:
    root: Path
    port: int
    proc: subprocess.Popen[bytes]
    sasl_port: int | None = None
    ssl_port: int | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sasl_bootstrap(self) -> str:
        """The SASL_PLAINTEXT listener (mechanism PLAIN), when started with ``sasl_users``."""
        assert self.sasl_port is not None, "the broker was started without sasl_users"
        return f"127.0.0.1:{self.sasl_port}"

    @property
    def ssl_bootstrap(self) -> str:
        """The SSL listener, when started with ``tls``."""
        assert self.ssl_port is not None, "the broker was started without tls"
        return f"127.0.0.1:{self.ssl_port}"

    def log_tail(self, lines: int = 60) -> str:
        log = self.root / "broker.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _java(lib: Path, main: str, *args: str, options: tuple[str, ...] = ()) -> list[str]:
    return ["java", *JAVA_OPTIONS, *options, "-cp", f"{lib}/*", main, *args]


def _jaas_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def start(root: Path, port: int | None = None, timeout: float = 120, *, sasl_users: dict[str, str] | None = None,
          tls: Tls | None = None) -> Broker:
    """Format ``root`` (unless a broker ran there before) and start a broker on it: a PLAINTEXT
    listener on ``port``, and on free ports a SASL_PLAINTEXT one (mechanism PLAIN) for
    ``sasl_users`` (username -> password) and an SSL one with ``tls``'s keystore. Brokers talk
    to each other (and the controller) over PLAINTEXT."""
    lib = fetch_jars()
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    controller = free_port()
    listeners = {"PLAINTEXT": port}
    security: list[str] = []
    if sasl_users:
        listeners["SASL_PLAINTEXT"] = free_port()
        admin = next(iter(sasl_users))
        jaas = " ".join(["org.apache.kafka.common.security.plain.PlainLoginModule required",
                         f"username={_jaas_quote(admin)} password={_jaas_quote(sasl_users[admin])}",
                         *(f"user_{user}={_jaas_quote(password)}" for user, password in sasl_users.items())]) + ";"
        security += ["sasl.enabled.mechanisms=PLAIN", f"listener.name.sasl_plaintext.plain.sasl.jaas.config={jaas}"]
    if tls is not None:
        listeners["SSL"] = free_port()
        security += [f"ssl.keystore.location={tls.keystore}", "ssl.keystore.type=PKCS12",
                     f"ssl.keystore.password={tls.password}", f"ssl.key.password={tls.password}",
                     "ssl.client.auth=none"]
    advertised = ",".join(f"{name}://127.0.0.1:{p}" for name, p in listeners.items())
    props = root / "server.properties"
    props.write_text("\n".join([
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.bootstrap.servers=127.0.0.1:{controller}",
        f"listeners={advertised},CONTROLLER://127.0.0.1:{controller}",
        f"advertised.listeners={advertised}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=" + ",".join(["CONTROLLER:PLAINTEXT", *(f"{n}:{n}" for n in listeners)]),
        *security,
        f"log.dirs={root / 'data'}",
        "num.partitions=1",
        "offsets.topic.replication.factor=1",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1",
        "group.initial.rebalance.delay.ms=0",
        "auto.create.topics.enable=false",
        "",
    ]))
    (root / "log4j2.properties").write_text(LOG4J2.format(log=root / "broker.log"))
    if not (root / "data" / "meta.properties").exists():
        cluster = subprocess.run(_java(lib, "kafka.tools.StorageTool", "random-uuid"), capture_output=True,
                                 text=True, check=True).stdout.strip() or uuid.uuid4().hex
        done = subprocess.run(_java(lib, "kafka.tools.StorageTool", "format", "--standalone", "-t", cluster,
                                    "-c", str(props)), capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"formatting the Kafka storage failed:\n{done.stdout}\n{done.stderr}")
    with (root / "broker.out").open("wb") as out:
        proc = subprocess.Popen(
            _java(lib, "kafka.Kafka", str(props),
                  options=(f"-Dlog4j2.configurationFile=file:{root / 'log4j2.properties'}",)),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    broker = Broker(root=root, port=port, proc=proc, sasl_port=listeners.get("SASL_PLAINTEXT"),
                    ssl_port=listeners.get("SSL"))
    _wait_ready(broker, timeout)
    return broker


def _wait_ready(broker: Broker, timeout: float) -> None:
    from confluent_kafka.admin import AdminClient

    deadline = time.monotonic() + timeout
    admin = None
    while True:
        if broker.proc.poll() is not None:
            raise RuntimeError(f"the Kafka broker exited ({broker.proc.returncode}):\n{broker.log_tail()}\n"
                               f"{(broker.root / 'broker.out').read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            broker.stop()
            raise RuntimeError(f"the Kafka broker did not answer within {timeout:.0f} s:\n{broker.log_tail()}")
        with socket.socket() as s:  # a client before the port listens would log every refused connect
            listening = s.connect_ex(("127.0.0.1", broker.port)) == 0
        if listening:
            admin = admin or AdminClient({"bootstrap.servers": broker.bootstrap})
            try:
                admin.list_topics(timeout=5)
                return
            except Exception:  # listening, not serving yet
                pass
        time.sleep(0.5)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9092)
    parser.add_argument("--data", type=Path, default=data_dir() / "kafka")
    args = parser.parse_args()
    broker = start(args.data, args.port)
    # The broker runs in a session of its own (a Ctrl-C meant for it must not reach it half-way
    # through a start): stop it on SIGTERM as on Ctrl-C, never leave it orphaned.
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"Kafka broker on {broker.bootstrap} (data and log in {args.data}); Ctrl-C stops it", flush=True)
    try:
        broker.proc.wait()
    except KeyboardInterrupt:
        broker.stop()
    sys.exit(broker.proc.returncode or 0)


if __name__ == "__main__":
    main()
