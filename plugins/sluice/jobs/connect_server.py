"""A Spark Connect server: the application ``sluice.spark.connect_server_command`` submits.

Spark's own ``SparkConnectServer`` forces per-session artifact isolation with a class loader
per session, and Spark's cache of generated code is keyed by the class loader: every session
(every group's client) missed it, so a warm server compiled the same ~95 classes again for
every group, and JIT-compiled them again. Here the Connect service runs as the driver plugin
(``SparkConnectPlugin``) of an application whose settings come from spark-submit alone
(``sluice.spark.CONNECT_SERVER_CONF``: isolation off), so a group's session reuses the code
earlier groups generated.

The driver waits until spark-submit's JVM ends (SIGTERM to it stops the service and this
process), or until it is itself told to stop.
"""

from __future__ import annotations

import os
import signal
import threading


def main() -> None:
    from pyspark.sql import SparkSession

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    spark = SparkSession.builder.getOrCreate()  # starts the Connect service (spark.plugins)
    parent = os.getppid()  # the driver JVM: this process is its child (PythonRunner)
    print(f"sluice connect server: Spark {spark.version} up", flush=True)
    while not stop.wait(1.0):
        if os.getppid() != parent:  # the JVM is gone: nothing left to serve
            return
    spark.stop()


if __name__ == "__main__":
    main()
