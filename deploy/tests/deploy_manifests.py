"""Checks deploy/docker, deploy/compose and deploy/k8s against the binaries they run.

Run by deploy/tests/deploy_manifests.rs with the built binaries' directory:
    python deploy_manifests.py REPO_ROOT BIN_DIR
Without a container engine or a Kubernetes cluster, it checks what can be checked here:
- every YAML file parses; the kustomize overlays render (`kubectl kustomize`, when kubectl is
  installed), and every rendered object of a built-in kind validates, strictly, against the
  Kubernetes API schema of its apiVersion (kubernetes-validate);
- every binary a Dockerfile copies exists and runs `--help`, and the image names the manifests
  use are the ones the Dockerfiles say they build;
- every flag and every environment variable a manifest gives a Fission process is one that
  process takes (its `--help` lists it), every port a Fission container declares is one its
  flags bind, and every metric an autoscaler queries is one the code exports.
Prints what it checked, and exits 1 listing every problem.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

import yaml

ROOT, BIN = sys.argv[1], sys.argv[2]
problems = []
checked = []
# Variables that are not Fission's flags: the OpenTelemetry SDK's, the downward API's, the HF
# cache's and the logger's.
STANDARD_ENV = {"POD_IP", "HF_HOME", "XDG_CACHE_HOME", "RUST_LOG", "OTEL_SERVICE_NAME",
                "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}
K8S_VERSION = "1.31.0"

_help = {}


def help_text(argv):
    """`fission ARGV --help` (ARGV a subcommand path), cached."""
    key = tuple(argv)
    if key not in _help:
        out = subprocess.run([os.path.join(BIN, "fission"), *argv, "--help"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            problems.append(f"fission {' '.join(argv)} --help failed: {out.stderr.strip()}")
        _help[key] = out.stdout
    return _help[key]


def takes_flag(argv, flag):
    return re.search(r"(^|\s)" + re.escape(flag) + r"([\s=,]|$)", help_text(argv), re.M) is not None


def takes_env(argv, name):
    return f"[env: {name}=" in help_text(argv) or f"[env: {name}]" in help_text(argv)


def subcommand(tokens):
    """The subcommand path at the start of a fission argv: `node decode`, `gateway`, ..."""
    path = []
    for t in tokens:
        if t.startswith("-"):
            break
        path.append(t)
        if t in ("gateway", "prefill", "decode", "start", "up", "generate"):
            break
    return path


def check_argv(where, tokens, env_names, ports):
    """A Fission process: its flags, its environment and its declared ports."""
    path = subcommand(tokens)
    flags = [t.split("=", 1)[0] for t in tokens[len(path):] if t.startswith("--")]
    for f in flags:
        if not takes_flag(path, f):
            problems.append(f"{where}: `fission {' '.join(path)}` has no flag {f}")
    for name in env_names:
        if name not in STANDARD_ENV and not takes_env(path, name):
            problems.append(f"{where}: `fission {' '.join(path)}` reads no variable {name}")
    bound = " ".join(tokens) + " " + " ".join(str(v) for v in env_names.values())
    for port in ports:
        if f":{port}" not in bound:
            problems.append(f"{where}: declares port {port}, which none of its flags binds")
    checked.append(f"{where}: fission {' '.join(path)} ({len(flags)} flags, {len(env_names)} variables, {len(ports)} ports)")


def load_yaml(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def dockerfiles():
    images = set()
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy/docker/Dockerfile*"))):
        text = open(path).read()
        tag = re.search(r"docker build .* -t (\S+) \.", text)
        if not tag:
            problems.append(f"{path}: no `docker build ... -t IMAGE .` line says what it builds")
        else:
            images.add(tag.group(1))
        bins = set(re.findall(r"target/release/([\w-]+)", text))
        if not bins:
            problems.append(f"{path}: copies no binary")
        for b in sorted(bins):
            exe = os.path.join(BIN, b)
            ok = os.path.exists(exe) and subprocess.run([exe, "--help"], capture_output=True, timeout=60).returncode == 0
            if not ok:
                problems.append(f"{path}: binary {b} does not exist or fails --help")
        for pkg in re.findall(r"-p ([\w-]+)", text):
            if not os.path.exists(os.path.join(ROOT, pkg.replace("deploy", "deploy"), "Cargo.toml")):
                problems.append(f"{path}: no crate {pkg}")
        checked.append(f"{os.path.basename(path)}: builds {tag.group(1) if tag else '?'}, binaries {sorted(bins)}")
    return images


def compose(images):
    path = os.path.join(ROOT, "deploy/compose/docker-compose.yml")
    doc = load_yaml(path)[0]
    for name, svc in doc["services"].items():
        image = svc.get("image", "")
        if not image.startswith("fission"):
            continue
        if image not in images:
            problems.append(f"compose {name}: image {image} is not one a Dockerfile builds")
        if name == "certs":
            continue
        command = " ".join(svc.get("command", []))
        m = re.search(r"fission (.*)", command)
        if not m:
            problems.append(f"compose {name}: runs no fission command")
            continue
        tokens = [t.strip('"') for t in m.group(1).split()]
        env = svc.get("environment", {})
        ports = [int(str(p).split("/")[0].split(":")[-1]) for p in svc.get("expose", []) + svc.get("ports", [])]
        check_argv(f"compose {name}", tokens, env, ports)
    prom = load_yaml(os.path.join(ROOT, "deploy/compose/prometheus.yml"))[0]
    if not prom.get("scrape_configs"):
        problems.append("compose prometheus.yml has no scrape_configs")


def kustomize(overlay):
    kubectl = shutil.which("kubectl")
    if not kubectl:
        return None
    out = subprocess.run([kubectl, "kustomize", overlay], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        problems.append(f"kubectl kustomize {overlay}: {out.stderr.strip()}")
        return []
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def exported_metrics():
    names = set()
    for src in glob.glob(os.path.join(ROOT, "*/src/**/*.rs"), recursive=True):
        names.update(re.findall(r'"(fission_[a-z_]+)"', open(src).read()))
    return names


def k8s_objects(objects, where, images, metrics):
    import kubernetes_validate
    config_env = {}
    for o in objects:
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "fission-config":
            config_env = dict(o["data"])
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    for o in objects:
        kind, name = o["kind"], o["metadata"]["name"]
        if o["apiVersion"].startswith("keda.sh/"):
            spec = o["spec"]
            if spec["scaleTargetRef"]["name"] not in deployments:
                problems.append(f"{where} ScaledObject {name}: scales {spec['scaleTargetRef']['name']}, which is not here")
            for t in spec["triggers"]:
                md = t["metadata"]
                float(md["threshold"])
                for metric in re.findall(r"(fission_[a-z_]+?)(?:_bucket)?[{\[]", md["query"]):
                    if metric not in metrics:
                        problems.append(f"{where} ScaledObject {name}: queries {metric}, which nothing exports")
            continue
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except Exception as e:  # noqa: BLE001 - the validator's own error types vary by version
            problems.append(f"{where} {kind} {name}: {str(e).splitlines()[0]}")
        if kind not in ("Deployment", "StatefulSet"):
            continue
        for c in o["spec"]["template"]["spec"]["containers"]:
            image = c["image"]
            if not image.startswith("fission"):
                continue
            if image not in images:
                problems.append(f"{where} {name}: image {image} is not one a Dockerfile builds")
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            uses_config = any(s.get("configMapRef", {}).get("name") == "fission-config" for s in c.get("envFrom", []))
            tokens = list(c.get("command", [])[1:]) + list(c.get("args", []))
            ports = [p["containerPort"] for p in c.get("ports", [])]
            check_argv(f"{where} {name}", tokens, env, ports)
            if uses_config:
                path = subcommand(tokens)
                unread = [k for k in config_env if k not in STANDARD_ENV and not takes_env(path, k)]
                config_env_users.setdefault(where, []).append((path, unread))
    # A shared variable must be read by at least one of the processes that get it.
    for where_, users in config_env_users.items():
        for key in config_env:
            if key in STANDARD_ENV:
                continue
            if all(key in unread for _, unread in users):
                problems.append(f"{where_}: fission-config's {key} is read by no process")


config_env_users = {}


def main():
    images = dockerfiles()
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy/compose/*.yml")) +
                       glob.glob(os.path.join(ROOT, "deploy/k8s/**/*.yaml"), recursive=True)):
        try:
            load_yaml(path)
        except yaml.YAMLError as e:
            problems.append(f"{path}: {e}")
    checked.append("every YAML file parses")
    compose(images)
    metrics = exported_metrics()
    rendered_any = False
    for overlay in sorted(glob.glob(os.path.join(ROOT, "deploy/k8s/overlays/*"))):
        objects = kustomize(overlay)
        if objects is None:
            break
        rendered_any = True
        where = "k8s/" + os.path.basename(overlay)
        checked.append(f"{where}: {len(objects)} objects rendered")
        k8s_objects(objects, where, images, metrics)
    if not rendered_any:
        print("kubectl is not installed: validating the base and components unrendered")
        objects = []
        for path in sorted(glob.glob(os.path.join(ROOT, "deploy/k8s/base/*.yaml")) +
                           glob.glob(os.path.join(ROOT, "deploy/k8s/etcd/*.yaml"))):
            objects += [o for o in load_yaml(path) if o.get("kind") != "Kustomization"]
        for o in objects:
            for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if c["image"] == "fission":
                    c["image"] = "fission:cpu"
        k8s_objects(objects, "k8s/base", images, metrics)
    for line in checked:
        print("checked:", line)
    if problems:
        print("\n".join("PROBLEM: " + p for p in problems))
        sys.exit(1)


main()
