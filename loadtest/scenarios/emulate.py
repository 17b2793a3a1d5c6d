#!/usr/bin/env python3
"""Scale emulation with real processes (issue 15): a cluster of mock nodes (`--engine mock`)
on one machine, with the real etcd, gateway, scheduler, KV accounting and KV transfer.

    loadtest/scenarios/emulate.py [--prefill 16] [--decode 32] [--profile h100-llama8b]
                                   [--rates 25,50,100] [--duration 20]

Measures, into .bench/emulate-<stamp>/:
  - the cluster's start-up time;
  - the etcd watch traffic of an idle cluster (puts/s the gateway's watches receive, watchers),
    and the gateway's and etcd's CPU while idle;
  - node join and leave propagation: from a node's etcd registration (its log) to the
    gateway's "node joined the pool", and from SIGTERM to "node is draining" / "node left";
  - open-loop levels through the gateway: TTFT/TPOT percentiles, goodput, gateway CPU per
    request, and the gateway's own added latency before a request leaves for a node
    (`fission_gateway_overhead_seconds`, p50/p99 from its histogram);
  - the simulator's prediction for the same cluster, profile, workload, rate and seed;
  - every node's KV gauges back at 0 after the load (asserted: the script fails otherwise).

Every load is bounded in time and count; all traffic stays on 127.0.0.1.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def wait_until(cond, timeout, what, period=0.01):
    """The one wait: polls `cond` until it returns a truthy value or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(period)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def cpu_s(pid):
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy():
    """(busy, total) jiffies of all CPUs since boot."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def metric_lines(text, name):
    return [l for l in text.splitlines() if l.startswith(name) and not l.startswith("#")]


def metric_sum(text, name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in metric_lines(text, name + " ") + metric_lines(text, name + "{"))


def buckets(text, name):
    out = {}
    for l in metric_lines(text, name + "_bucket"):
        le = re.search(r'le="([^"]+)"', l).group(1)
        out[float("inf") if le == "+Inf" else float(le)] = float(l.rsplit(" ", 1)[1])
    return out


def quantile(before, after, q):
    """The upper bound of the bucket holding quantile q of the samples between two scrapes."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    total = counts[-1] if counts else 0
    if total <= 0:
        return None, 0
    for le, c in zip(les, counts):
        if c >= q * total:
            return le, int(total)
    return les[-1], int(total)


def log_time(line):
    m = STAMP.match(ANSI.sub("", line))
    return datetime.fromisoformat(m.group(1)[:26]).timestamp() if m else None


class Tail:
    """Lines of a log file as they are written."""

    def __init__(self, path):
        self.path, self.pos, self.lines = path, 0, []

    def poll(self):
        with open(self.path, errors="replace") as f:
            f.seek(self.pos)
            chunk = f.read()
            self.pos = f.tell()
        self.lines += [ANSI.sub("", l) for l in chunk.splitlines()]
        return self.lines

    def find(self, *needles):
        for l in self.poll():
            if all(n in l for n in needles):
                return l
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--profile", default="h100-llama8b")
    ap.add_argument("--rates", default="25,50,100")
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--slo-ttft-ms", type=float, default=500)
    ap.add_argument("--slo-tpot-ms", type=float, default=50)
    ap.add_argument("--join-leave-rounds", type=int, default=5)
    # The emulated nodes share this machine's cores with the gateway, which a deployment
    # would not do: with N > 0 they run at nice N, so that the gateway's added latency is the
    # gateway's own and not a wait for a core behind 48 node processes.
    ap.add_argument("--nodes-nice", type=int, default=0)
    ap.add_argument("--port", type=int, default=18280)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = Path(a.out or ROOT / ".bench" / f"emulate-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    (out / "lscpu.txt").write_text(lscpu)
    results = {"config": vars(a), "cpu": re.search(r"Model name:\s*(.*)", lscpu).group(1)}

    up_log = out / "up.log"
    started = time.monotonic()
    up = subprocess.Popen(
        [BIN / "fission", "up", "--engine", "mock", "--cost-profile", a.profile,
         "--prefill", str(a.prefill), "--decode", str(a.decode), "--port", str(a.port),
         "--ready-timeout-s", "600"],
        stdout=open(up_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    tail = Tail(up_log)
    procs = []
    try:
        wait_until(lambda: tail.find("Fission is up") or up.poll() is not None, 600, "fission up", 0.2)
        if up.poll() is not None:
            raise RuntimeError(f"fission up exited: see {up_log}")
        results["startup_s"] = time.monotonic() - started
        log(f"{a.prefill}P+{a.decode}D up in {results['startup_s']:.1f} s")
        lines = tail.poll()
        gw = f"http://127.0.0.1:{a.port}"
        node_metrics = [m.group(1) for l in lines if (m := re.search(r"^(?:decode|prefill)-\d+ grpc=\S+ metrics=(\S+)", l))]
        join = next(l for l in lines if l.startswith("add a node:")).split(": ", 1)[1]
        operate = next(l for l in lines if l.startswith("operate:")).split(": ", 1)[1]
        etcd = re.search(r"--etcd (\S+)", join).group(1)
        tls = {k: re.search(rf"--{k} (\S+)", operate).group(1) for k in ("tls-ca", "tls-cert", "tls-key")}
        children = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(up.pid)], capture_output=True, text=True).stdout
        gw_pid = int(next(l for l in children.splitlines() if " gateway " in l).split()[0])
        etcd_pid = int(next(l for l in children.splitlines() if "etcd" in l.split()[1]).split()[0])
        node_pids = [int(l.split()[0]) for l in children.splitlines() if " node " in l]
        if a.nodes_nice:
            for pid in node_pids:
                # Every thread: renice acts on one task at a time.
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), a.nodes_nice)
            log(f"{len(node_pids)} node processes at nice {a.nodes_nice}")
        results["nodes_nice"] = a.nodes_nice

        def etcd_metrics():
            return subprocess.run(
                ["curl", "-s", "--cacert", tls["tls-ca"], "--cert", tls["tls-cert"], "--key", tls["tls-key"], etcd + "/metrics"],
                capture_output=True, text=True, timeout=10).stdout

        # The idle cluster: what 48 nodes' load reports and leases cost etcd and the gateway.
        idle_s = 10.0
        m0, g0, e0, t0 = etcd_metrics(), cpu_s(gw_pid), cpu_s(etcd_pid), time.monotonic()
        time.sleep(idle_s)  # a measurement window, not a wait for a condition
        m1, g1, e1, t1 = etcd_metrics(), cpu_s(gw_pid), cpu_s(etcd_pid), time.monotonic()
        dt = t1 - t0
        results["idle"] = {
            "etcd_puts_per_s": (metric_sum(m1, "etcd_mvcc_put_total") - metric_sum(m0, "etcd_mvcc_put_total")) / dt,
            "etcd_watch_events_per_s": (metric_sum(m1, "etcd_debugging_mvcc_events_total") - metric_sum(m0, "etcd_debugging_mvcc_events_total")) / dt,
            "etcd_watchers": metric_sum(m1, "etcd_debugging_mvcc_watcher_total"),
            "etcd_watch_streams": metric_sum(m1, "etcd_debugging_mvcc_watch_stream_total"),
            "etcd_lease_keepalives_per_s": (metric_sum(m1, "etcd_server_lease_keepalive_total") - metric_sum(m0, "etcd_server_lease_keepalive_total")) / dt,
            "gateway_cpu_pct": 100 * (g1 - g0) / dt,
            "etcd_cpu_pct": 100 * (e1 - e0) / dt,
        }
        log("idle:", json.dumps(results["idle"]))

        # Join and leave: one more decode node, started with the printed command, then drained.
        rounds = []
        for r in range(a.join_leave_rounds):
            name = f"decode-join-{r}"
            cmd = join.replace("decode|prefill", "decode").replace("--role decode", "--role decode").split()
            cmd[0] = str(BIN / "fission")
            node_log = out / f"{name}.log"
            p = subprocess.Popen(cmd + ["--node-id", name], stdout=open(node_log, "w"), stderr=subprocess.STDOUT)
            procs.append(p)
            nt = Tail(node_log)
            reg = wait_until(lambda: nt.find("registered in etcd", name), 120, f"{name} registering")
            joined = wait_until(lambda: tail.find("node joined the pool", f"node_id={name}"), 30, f"gateway seeing {name}")
            ready = wait_until(lambda: tail.find("node ready", f"node_id={name}"), 30, f"{name} ready")
            sent = time.time()
            p.send_signal(signal.SIGTERM)
            draining = wait_until(lambda: tail.find("node is draining", f"node_id={name}"), 30, f"{name} draining")
            left = wait_until(lambda: tail.find("node left the pool", f"node_id={name}"), 60, f"{name} leaving")
            p.wait(timeout=60)
            rounds.append({
                "join_ms": 1e3 * (log_time(joined) - log_time(reg)),
                "ready_ms": 1e3 * (log_time(ready) - log_time(reg)),
                "drain_seen_ms": 1e3 * (log_time(draining) - sent),
                "left_ms": 1e3 * (log_time(left) - sent),
            })
            log(name, rounds[-1])
        results["join_leave"] = rounds

        # Open-loop levels through the gateway.
        levels = []
        for rate in [float(x) for x in a.rates.split(",")]:
            tag = f"rate{rate:g}"
            gm0, c0, mb0 = get(gw + "/metrics"), cpu_s(gw_pid), machine_busy()
            lt = subprocess.run(
                [BIN / "fission-loadtest", "--url", gw, "--rate", str(rate), "--duration", f"{a.duration}s",
                 "--max-requests", str(int(rate * a.duration * 2) + 10), "--input-len", str(a.input_len),
                 "--output-len", str(a.output_len), "--slo-ttft-ms", str(a.slo_ttft_ms),
                 "--slo-tpot-ms", str(a.slo_tpot_ms), "--seed", "1", "--json", out / f"{tag}.json"],
                capture_output=True, text=True, timeout=a.duration * 10 + 120)
            (out / f"{tag}.md").write_text(lt.stdout + lt.stderr)
            gm1, c1, mb1 = get(gw + "/metrics"), cpu_s(gw_pid), machine_busy()
            s = json.loads((out / f"{tag}.json").read_text())["levels"][0]["summary"]
            b0, b1 = buckets(gm0, "fission_gateway_overhead_seconds"), buckets(gm1, "fission_gateway_overhead_seconds")
            p50, n = quantile(b0, b1, 0.50)
            p99, _ = quantile(b0, b1, 0.99)
            sim = subprocess.run(
                [BIN / "fission-loadtest", "simulate", "--cluster", f"{a.prefill}P+{a.decode}D", "--profile", a.profile,
                 "--rate", str(rate), "--duration", f"{a.duration}s", "--input-len", str(a.input_len),
                 "--output-len", str(a.output_len), "--slo-ttft-ms", str(a.slo_ttft_ms),
                 "--slo-tpot-ms", str(a.slo_tpot_ms), "--seed", "1", "--json", out / f"{tag}-sim.json"],
                capture_output=True, text=True, timeout=600)
            (out / f"{tag}-sim.md").write_text(sim.stdout + sim.stderr)
            ss = json.loads((out / f"{tag}-sim.json").read_text())["levels"][0]["summary"]
            level = {
                "rate": rate, "ok": s["ok"], "failed": s["failed"], "errors": s["errors"],
                "throughput_rps": s["throughput_rps"], "output_tok_s": s["output_tokens_per_s"],
                "slo_attainment": s["slo_attainment"], "meets_slo": s["meets_slo"],
                "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"],
                "gateway_cpu_ms_per_request": 1e3 * (c1 - c0) / max(s["requests"], 1),
                "gateway_cpu_pct": 100 * (c1 - c0) / s["wall_s"],
                "machine_busy_pct": 100 * (mb1[0] - mb0[0]) / max(mb1[1] - mb0[1], 1),
                "overhead_p50_le_ms": p50 and 1e3 * p50, "overhead_p99_le_ms": p99 and 1e3 * p99,
                "overhead_samples": n,
                "sim": {"ttft_ms": ss["ttft_ms"], "tpot_ms": ss["tpot_ms"], "throughput_rps": ss["throughput_rps"],
                        "slo_attainment": ss["slo_attainment"]},
            }
            levels.append(level)
            log(f"{tag}: ok {s['ok']}/{s['requests']} attainment {s['slo_attainment']:.3f} TTFT p50/p90 "
                f"{s['ttft_ms']['p50']:.1f}/{s['ttft_ms']['p90']:.1f} (sim {ss['ttft_ms']['p50']:.1f}/{ss['ttft_ms']['p90']:.1f}) "
                f"TPOT {s['tpot_ms']['p50']:.2f}/{s['tpot_ms']['p90']:.2f} (sim {ss['tpot_ms']['p50']:.2f}/{ss['tpot_ms']['p90']:.2f}) "
                f"gw {level['gateway_cpu_ms_per_request']:.2f} ms CPU/req, overhead p50/p99 <= {level['overhead_p50_le_ms']}/{level['overhead_p99_le_ms']} ms, "
                f"machine busy {level['machine_busy_pct']:.0f}%")
        results["levels"] = levels

        # Nothing leaks: every node's KV gauges return to 0 once the load has ended.
        def kv_in_use():
            total = 0.0
            for url in node_metrics:
                text = get(url)
                for name in ("fission_decode_kv_blocks_used", "fission_decode_kv_blocks_reserved", "fission_prefill_kv_blocks_used"):
                    total += metric_sum(text, name)
            return total

        wait_until(lambda: kv_in_use() == 0, 60, "every KV gauge back at 0", 0.5)
        results["kv_blocks_in_use_after"] = 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    log(f"wrote {out}/results.json")


if __name__ == "__main__":
    main()
