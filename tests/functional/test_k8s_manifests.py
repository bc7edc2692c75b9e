"""The Kubernetes manifests of deploy/k8s/ (a kustomize base): every object validates against
the Kubernetes API schemas with no unknown field (kubernetes-validate ships them: no network),
the base lists every manifest, every argument a pod passes is one the CLI takes once the
kubelet has expanded its $(VAR)s (the agent's, the coordinator's, and the agent's preStop
drain with the client environment it reads), the agent asks for each privilege it needs and
says why, the coordinator asks for none, the pods wait for the drain, and every Secret named
is one the README tells how to create. As test_systemd.py does for the systemd units."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from snapshotter import __version__
from snapshotter.cli import connect
from snapshotter.cli.main import build_parser
from snapshotter.rpc.tls import COORDINATOR_NAME, tls_files
from tests.support.cli import ROOT

K8S = ROOT / "deploy" / "k8s"
# The oldest release the base is meant for, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
IMAGE = "ghcr.io/snapshotter/snapshotter"
# What the downward API gives a pod on a sample node.
FIELDS = {"spec.nodeName": "gpu-node-1", "status.hostIP": "10.0.0.11", "status.podIP": "10.1.2.3"}
NODE, NODE_IP = FIELDS["spec.nodeName"], FIELDS["status.hostIP"]

Obj = dict[str, Any]


def _kustomization() -> Obj:
    k: Obj = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return k


def _objects() -> list[tuple[str, Obj]]:
    """(file, object) for every object of every manifest the base lists."""
    out = []
    for name in _kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc is not None:
                out.append((name, doc))
    return out


def _one(kind: str, name: str | None = None) -> Obj:
    found = [o for _, o in _objects() if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]  # fmt: skip
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod(kind: str) -> Obj:
    spec: Obj = _one(kind)["spec"]["template"]["spec"]
    return spec


def _container(kind: str) -> Obj:
    (c,) = _pod(kind)["containers"]
    return dict(c)


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion, except that an undefined VAR fails here (the kubelet
    leaves it as it is: a flag then silently gets the text "$(VAR)")."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def _env(container: Obj) -> dict[str, str]:
    """The container's environment as the kubelet builds it on the sample node: envFrom's
    ConfigMaps (from the base), then env in order, each value expanded with what precedes it.
    A Secret's values are unknown here, so nothing may expand one."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            env.update(_one("ConfigMap", src["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = _expand(e["value"], env)
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = _one("ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def _volume_at(kind: str, path: str) -> tuple[Obj, str]:
    """The volume mounted over `path` in `kind`'s container, and `path` relative to it."""
    p = PurePosixPath(path)
    mounts = [m for m in _container(kind)["volumeMounts"] if p.is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of the {kind}'s container"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    (vol,) = [v for v in _pod(kind)["volumes"] if v["name"] == m["name"]]
    return vol, str(p.relative_to(m["mountPath"]))


def _prestop() -> list[str]:
    """The agent's preStop command as the shell runs it: `sh -c SCRIPT`, whose one command is
    `exec snapshotter drain ...` with $VAR expanded from the container's environment."""
    c = _container("DaemonSet")
    cmd = c["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[:2] == ["/bin/sh", "-c"] and len(cmd) == 3, cmd
    words = shlex.split(cmd[2])
    assert words[0] == "exec" and not {";", "&&", "||", "|"} & set(words), cmd[2]
    env = _env(c)
    return [re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], w) for w in words[1:]]


# ---------------------------------------------------------------------------- the manifests


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(version: str) -> None:
    objects = _objects()
    assert objects
    for name, obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)  # unknown fields fail
        except kubernetes_validate.ValidationError as e:
            where = ".".join(map(str, e.path))
            pytest.fail(f"{name}: {obj['kind']} {obj['metadata'].get('name')}: {where}: "
                        f"{e.message} (Kubernetes {version})")  # fmt: skip
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{name}: {e.message}")


def test_the_base_lists_every_manifest_and_ships_no_secret() -> None:
    listed = _kustomization()["resources"]
    present = {p.name for p in K8S.iterdir() if p.suffix in (".yaml", ".yml")}
    present -= {"kustomization.yaml"}
    present -= {n for n in present if n.endswith((".example.yaml", ".example.yml"))}
    assert sorted(listed) == sorted(present), "kustomization.yaml resources vs files here"
    assert len(set(listed)) == len(listed)
    assert not [o for _, o in _objects() if o["kind"] == "Secret"], "Secrets are never committed"


def test_the_images_are_this_release() -> None:
    tags = {i["name"]: i["newTag"] for i in _kustomization()["images"]}
    assert tags == {IMAGE: __version__}
    for kind in ("Deployment", "DaemonSet"):
        assert _container(kind)["image"] == f"{IMAGE}:{__version__}", kind


def test_the_base_builds_into_its_namespace() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    p = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    built = [o for o in yaml.safe_load_all(p.stdout) if o]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in built) == sorted(
        (o["kind"], o["metadata"]["name"]) for _, o in _objects()
    )
    namespace = _kustomization()["namespace"]
    for o in built:
        kubernetes_validate.validate(o, KUBERNETES_VERSIONS[-1], strict=True)
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "snapshotter", o["kind"]
        if o["kind"] not in ("Namespace", "PriorityClass"):  # the cluster-scoped ones
            assert o["metadata"]["namespace"] == namespace, o["kind"]


# ---------------------------------------------------------------------------- the CLI


def test_the_agents_arguments_are_the_clis() -> None:
    c = _container("DaemonSet")
    env = _env(c)
    # The shell only raises the ranks' limits, then execs the agent with the args as given.
    sh, dash_c, script, zero = c["command"]
    assert (sh, dash_c, zero) == ("/bin/sh", "-c", "snapshotter"), c["command"]
    assert "ulimit -l unlimited" in script and "ulimit -n " in script, script
    assert script.endswith('&& exec "$0" "$@"'), script
    argv = [_expand(x, env) for x in c["args"]]
    a = build_parser().parse_args(argv)  # an unknown flag exits here
    assert a.cmd == "agent" and a.name == NODE and a.keeper
    assert a.listen == f"{NODE_IP}:7071" and a.metrics_listen == f"{NODE_IP}:9465"
    assert a.coordinator == env["SNAPSHOTTER_COORDINATOR"]
    # Its own pair from the node Secret (by node name: one template for every node), and the
    # job root mounted from the host at the same path.
    tls = tls_files(a.tls_dir, f"nodes/{a.name}", a.tls_ca, a.tls_cert, a.tls_key)
    assert tls is not None
    for path, file in ((tls.ca, "ca.crt"), (tls.cert, f"{NODE}.crt"), (tls.key, f"{NODE}.key")):
        vol, rel = _volume_at("DaemonSet", str(path))
        assert vol["secret"]["secretName"] == "snapshotter-node-tls" and rel == file, path
    assert a.allow_cwd == [env["JOB_ROOT"]]
    vol, rel = _volume_at("DaemonSet", env["JOB_ROOT"])
    assert vol["hostPath"]["path"] == env["JOB_ROOT"] and rel == "."
    vol, rel = _volume_at("DaemonSet", env["SNAPSHOTTER_HOME"])
    assert vol["hostPath"]["path"] == "/var/lib/snapshotter" and rel == "."
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 7071, "metrics": 9465}


def test_the_coordinators_arguments_are_the_clis() -> None:
    c = _container("Deployment")
    env = _env(c)
    assert c["command"] == ["snapshotter"]
    a = build_parser().parse_args([_expand(x, env) for x in c["args"]])
    assert a.cmd == "coordinator" and not a.insecure
    assert a.store is None and env["SNAPSHOTTER_STORE"].startswith("s3://")
    tls = tls_files(a.tls_dir, COORDINATOR_NAME, a.tls_ca, a.tls_cert, a.tls_key)
    assert tls is not None
    for path in (tls.ca, tls.cert, tls.key):
        vol, rel = _volume_at("Deployment", str(path))
        assert vol["secret"]["secretName"] == "snapshotter-coordinator-tls", path
        assert rel in [i["path"] for i in vol["secret"]["items"]], path
    vol, rel = _volume_at("Deployment", env["SNAPSHOTTER_HOME"])
    assert vol["persistentVolumeClaim"]["claimName"] == "snapshotter-coordinator-state"
    # The Service reaches the ports it listens on, at the address the agents are given.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(a.listen.rsplit(":", 1)[1]) == ports["grpc"] == 7070
    assert int(a.metrics_listen.rsplit(":", 1)[1]) == ports["metrics"] == 9464
    svc = _one("Service", "snapshotter-coordinator")
    assert {p["port"]: ports[p["targetPort"]] for p in svc["spec"]["ports"]} == {
        7070: 7070, 9464: 9464}  # fmt: skip
    pod_labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    namespace = _kustomization()["namespace"]
    assert env["SNAPSHOTTER_COORDINATOR"] == f"snapshotter-coordinator.{namespace}.svc:7070"


def test_the_agents_prestop_drains_its_own_node_with_its_own_certificate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = _prestop()
    assert argv[0] == "snapshotter"
    a = build_parser().parse_args(argv[1:])
    assert a.cmd == "drain" and a.node == NODE and a.self and not a.undo
    assert a.grace is not None and a.grace > 0
    # The drain is a client of the coordinator: its environment names the node's own pair,
    # the very files the agent presents, and no admin credential.
    env = _env(_container("DaemonSet"))
    for k in ("SNAPSHOTTER_TLS_DIR", "SNAPSHOTTER_TLS_NAME", "SNAPSHOTTER_TOKEN",
              "SNAPSHOTTER_TOKEN_FILE", "SNAPSHOTTER_TLS_SERVER_NAME"):  # fmt: skip
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        if k.startswith("SNAPSHOTTER_"):
            monkeypatch.setenv(k, v)
    target = connect.configured_target()
    assert target is not None and target.address == env["SNAPSHOTTER_COORDINATOR"]
    assert target.token is None and target.tls is not None
    agent = build_parser().parse_args([_expand(x, env) for x in _container("DaemonSet")["args"]])
    assert (str(target.tls.ca), str(target.tls.cert), str(target.tls.key)) == (
        agent.tls_ca, agent.tls_cert, agent.tls_key)  # fmt: skip


def test_the_agent_pod_waits_for_its_drain() -> None:
    argv = _prestop()
    grace = build_parser().parse_args(argv[1:]).grace
    pod = _pod("DaemonSet")
    assert pod["terminationGracePeriodSeconds"] > grace
    # A SIGTERM that finds jobs still running drains with the same grace (daemon.py).
    assert float(_env(_container("DaemonSet"))["SNAPSHOTTER_DRAIN_GRACE_S"]) == grace


# ---------------------------------------------------------------------------- privileges


def test_the_agent_asks_for_what_criu_needs_and_says_why() -> None:
    pod, c = _pod("DaemonSet"), _container("DaemonSet")
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["hostPID"] is True
    assert c["securityContext"]["privileged"] is True
    assert pod["automountServiceAccountToken"] is False
    # Restarting the container would kill the node's ranks; they also live in its cgroup.
    assert "livenessProbe" not in c and "limits" not in c["resources"]
    assert pod["priorityClassName"] == _one("PriorityClass")["metadata"]["name"]
    # Every privilege is asked for right under a comment saying why.
    lines = (K8S / "agent.yaml").read_text().splitlines()
    for ask in ("hostNetwork: true", "hostPID: true", "privileged: true"):
        (i,) = [n for n, x in enumerate(lines) if x.strip() == ask]
        assert lines[i - 1].strip().startswith("#"), f"no comment says why {ask}"


def test_the_coordinator_asks_for_no_privilege() -> None:
    dep, pod, c = _one("Deployment"), _pod("Deployment"), _container("Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(host), host
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    sc = c["securityContext"]
    assert not sc.get("privileged") and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # TCP: the kubelet's gRPC probe cannot present the client certificate mutual TLS
        # asks for in the handshake.
        assert c[probe]["tcpSocket"]["port"] == "grpc", probe


def test_no_service_account_can_use_the_kubernetes_api() -> None:
    kinds = {o["kind"] for _, o in _objects()}
    assert not kinds & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
    for kind in ("Deployment", "DaemonSet"):
        sa = _one("ServiceAccount", _pod(kind)["serviceAccountName"])
        assert sa["automountServiceAccountToken"] is False, kind


# ---------------------------------------------------------------------------- references


def _references(pod: Obj) -> dict[str, set[tuple[str, str | None]]]:
    """Every Secret, ConfigMap and claim a pod names, with the key where one is named."""
    refs: dict[str, set[tuple[str, str | None]]] = {"Secret": set(), "ConfigMap": set(),
                                                    "PersistentVolumeClaim": set()}  # fmt: skip
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        for src in c.get("envFrom", []):
            if "secretRef" in src:
                refs["Secret"].add((src["secretRef"]["name"], None))
            if "configMapRef" in src:
                refs["ConfigMap"].add((src["configMapRef"]["name"], None))
        for e in c.get("env", []):
            vf = e.get("valueFrom", {})
            if "secretKeyRef" in vf:
                refs["Secret"].add((vf["secretKeyRef"]["name"], vf["secretKeyRef"]["key"]))
            if "configMapKeyRef" in vf:
                ref = vf["configMapKeyRef"]
                refs["ConfigMap"].add((ref["name"], ref["key"]))
    for v in pod.get("volumes", []):
        sources = [v, *v.get("projected", {}).get("sources", [])]
        for s in sources:
            if "secret" in s:
                name = s["secret"].get("secretName") or s["secret"]["name"]
                keys = [i["key"] for i in s["secret"].get("items", [])] or [None]
                refs["Secret"] |= {(name, k) for k in keys}
            if "configMap" in s:
                keys = [i["key"] for i in s["configMap"].get("items", [])] or [None]
                refs["ConfigMap"] |= {(s["configMap"]["name"], k) for k in keys}
        if "persistentVolumeClaim" in v:
            refs["PersistentVolumeClaim"].add((v["persistentVolumeClaim"]["claimName"], None))
    return refs


def test_every_secret_named_is_documented_and_everything_else_shipped() -> None:
    readme = (K8S / "README.md").read_text()
    documented = set(re.findall(r"create secret generic\s+([\w.-]+)", readme))
    used: set[str] = set()
    for kind in ("Deployment", "DaemonSet"):
        refs = _references(_pod(kind))
        for name, key in refs["Secret"]:
            assert name in documented, f"the {kind} names Secret {name}: README.md must say how"
            # The key has to come from the documented command or its table row.
            assert key is None or key in readme, f"Secret {name}'s key {key} is not in README"
            used.add(name)
        for name, key in refs["ConfigMap"]:
            data = _one("ConfigMap", name)["data"]
            assert key is None or key in data, f"ConfigMap {name} has no key {key}"
        for name, _ in refs["PersistentVolumeClaim"]:
            _one("PersistentVolumeClaim", name)
        _one("ServiceAccount", _pod(kind)["serviceAccountName"])
    assert documented == used, "README.md documents a Secret nothing uses, or misses one"
