//! The deployment files (issue 22 item 4, docs/cluster.md "Deployment"), offline and
//! without VMs: every manifest under deploy/kubernetes validates against the Kubernetes
//! schemas (`kubernetes-validate --strict`, the PyPI package scripts/setup.sh installs in
//! the test venv; its schemas ship with it), and a broken one does not; the DaemonSet
//! gives the node what it needs (privileged, host network, /dev/kvm and /dev/net/tun, the
//! state dir on a hostPath, a grace period longer than the shutdown, the environment that
//! names the node, its address and the API key) and the ConfigMap's config, with that
//! environment, is one the server accepts; the Services select the pods and the peers'
//! name is the headless one; both HAProxy configs pass `haproxy -c`, deploy/haproxy's with
//! exactly the variables tests/common/cluster.rs sets.

mod common;

use common::sdk::TOOLS;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(ROOT).join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 5,
        "manifests in {}: {files:?}",
        dir.display()
    );
    files
}

fn venv(program: &str) -> String {
    let path = format!("{TOOLS}/venv/bin/{program}");
    assert!(
        Path::new(&path).exists(),
        "{path} is missing: run scripts/setup.sh"
    );
    path
}

/// `kubernetes-validate --strict` on `files`: (success, output).
fn validate(files: &[PathBuf]) -> (bool, String) {
    let out = Command::new(venv("kubernetes-validate"))
        .args(["--strict", "--quiet"])
        .args(files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Every document of every manifest, as JSON (PyYAML, which kubernetes-validate brings).
fn documents() -> Vec<Value> {
    const TO_JSON: &str = "import json, sys, yaml\n\
        docs = [d for f in sys.argv[1:] for d in yaml.safe_load_all(open(f)) if d]\n\
        print(json.dumps(docs))";
    let out = Command::new(venv("python"))
        .args(["-c", TO_JSON])
        .args(manifests())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    match serde_json::from_slice(&out.stdout).unwrap() {
        Value::Array(docs) => docs,
        other => panic!("{other}"),
    }
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/kubernetes"))
}

fn by_name<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {list}"))
}

#[test]
fn every_manifest_validates_against_the_kubernetes_schemas() {
    let (ok, out) = validate(&manifests());
    assert!(ok, "{out}");
    // The validator does look: a wrongly typed and a misspelt field are refused.
    let dir = std::env::temp_dir().join(format!("aenv-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let daemonset =
        std::fs::read_to_string(Path::new(ROOT).join("deploy/kubernetes/daemonset.yaml")).unwrap();
    for (from, to) in [
        ("hostNetwork: true", "hostNetwork: \"yes\""),
        ("hostNetwork: true", "hostNetwrk: true"),
    ] {
        assert!(daemonset.contains(from));
        let bad = dir.join("bad.yaml");
        std::fs::write(&bad, daemonset.replacen(from, to, 1)).unwrap();
        let (ok, out) = validate(&[bad]);
        assert!(!ok, "{to} passed: {out}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The DaemonSet's environment as one pod on node `node` at `ip` gets it.
fn pod_env(container: &Value, node: &str, ip: &str, api_key: &str) -> Vec<(String, String)> {
    let env = &container["env"];
    let field = |name: &str| by_name(env, name)["valueFrom"]["fieldRef"]["fieldPath"].clone();
    assert_eq!(field("AENV_CLUSTER_NODE"), "spec.nodeName");
    assert_eq!(field("AENV_POD_IP"), "status.podIP");
    let secret = &by_name(env, "AENV_API_KEY")["valueFrom"]["secretKeyRef"];
    assert_eq!(secret["name"], "agentenv-api-key");
    assert_eq!(secret["key"], "api-key");
    let advertise = by_name(env, "AENV_CLUSTER_ADVERTISE_URL")["value"]
        .as_str()
        .unwrap()
        .replace("$(AENV_POD_IP)", ip);
    vec![
        ("AENV_CLUSTER_NODE".into(), node.into()),
        ("AENV_CLUSTER_ADVERTISE_URL".into(), advertise),
        ("AENV_API_KEY".into(), api_key.into()),
    ]
}

/// The DaemonSet, its pod spec and its one container.
fn daemonset(docs: &[Value]) -> (&Value, &Value, &Value) {
    let ds = find(docs, "DaemonSet", "agentenv");
    let pod = &ds["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    (ds, pod, &containers[0])
}

/// The hostPath of the volume container `c` of `pod` mounts at `path`.
fn host_path<'a>(pod: &'a Value, c: &Value, path: &str) -> &'a Value {
    let m = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == path)
        .unwrap_or_else(|| panic!("nothing mounted at {path}"));
    let name = m["name"].as_str().unwrap();
    &by_name(&pod["volumes"], name)["hostPath"]
}

/// The ConfigMap's config.toml.
fn configmap_toml(docs: &[Value]) -> &str {
    let cm = find(docs, "ConfigMap", "agentenv-config");
    cm["data"]["config.toml"].as_str().unwrap()
}

/// The ConfigMap's config as the pod on node `worker-1` at 10.0.0.7 loads it.
fn worker_config(docs: &[Value], c: &Value) -> agentenv::config::Config {
    let env = pod_env(c, "worker-1", "10.0.0.7", common::API_KEY);
    agentenv::config::Config::from_sources(Some(("configmap.yaml", configmap_toml(docs))), &env)
        .unwrap_or_else(|e| panic!("the ConfigMap's config is refused: {e}"))
}

/// The port of `[server] listen`.
fn api_port(config: &agentenv::config::Config) -> u64 {
    config
        .server
        .listen
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn the_daemonset_runs_one_privileged_container_on_the_host_network() {
    let docs = documents();
    let (ds, pod, c) = daemonset(&docs);
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
    assert_eq!(ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"], 0);
    assert_eq!(c["securityContext"]["privileged"], true);
    assert!(
        c["resources"]["limits"]["memory"].is_null(),
        "VMs count in the pod's cgroup"
    );
}

#[test]
fn the_daemonset_mounts_each_device_and_host_dir_where_it_is() {
    let docs = documents();
    let (_, pod, c) = daemonset(&docs);
    for (path, kind) in [("/dev/kvm", "CharDevice"), ("/dev/net/tun", "CharDevice")] {
        assert_eq!(host_path(pod, c, path)["path"], path);
        assert_eq!(host_path(pod, c, path)["type"], kind);
    }
    for path in ["/var/run/netns", "/run/agentenv"] {
        assert_eq!(host_path(pod, c, path)["path"], path);
    }
}

#[test]
fn the_configmaps_config_with_a_pods_environment_is_accepted_and_agrees_with_the_pod() {
    let docs = documents();
    let (_, pod, c) = daemonset(&docs);
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args, ["serve", "--config", "/etc/agentenv/config.toml"]);
    let config_volume = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/etc/agentenv")
        .expect("the config is mounted at /etc/agentenv");
    assert_eq!(
        by_name(&pod["volumes"], config_volume["name"].as_str().unwrap())["configMap"]["name"],
        "agentenv-config"
    );
    let config = worker_config(&docs, c);
    assert_eq!(config.cluster.node.as_deref(), Some("worker-1"));
    let state = config.server.state_dir.display().to_string();
    assert_eq!(host_path(pod, c, &state)["path"], state.as_str());
    assert_eq!(host_path(pod, c, &state)["type"], "DirectoryOrCreate");
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace >= config.server.shutdown_timeout_secs + 30,
        "grace period {grace} s leaves the shutdown pause ({} s) too little",
        config.server.shutdown_timeout_secs
    );
    let port = api_port(&config);
    assert_eq!(by_name(&c["ports"], "api")["containerPort"], port);
    assert_eq!(
        config.cluster.advertise_url,
        format!("http://10.0.0.7:{port}")
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
    assert!(
        !config.vm.assets_dir.starts_with(&config.server.state_dir),
        "the state dir's hostPath would hide the image's assets"
    );
}

#[test]
fn a_kubernetes_node_name_too_long_for_a_node_name_is_refused_at_startup() {
    let docs = documents();
    let (_, _, c) = daemonset(&docs);
    let toml = configmap_toml(&docs);
    let long = pod_env(c, "ip-10-0-0-7.ec2.internal", "10.0.0.7", common::API_KEY);
    assert!(agentenv::config::Config::from_sources(Some(("configmap.yaml", toml)), &long).is_err());
}

#[test]
fn the_services_select_the_pods_and_the_peers_are_the_headless_services_addresses() {
    let docs = documents();
    let (ds, _, c) = daemonset(&docs);
    let config = worker_config(&docs, c);
    let port = api_port(&config);
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&ds["spec"]["selector"]["matchLabels"], labels);
    let peers = find(&docs, "Service", "agentenv-peers");
    assert_eq!(peers["spec"]["clusterIP"], "None");
    let ns = ds["metadata"]["namespace"].as_str().unwrap();
    assert_eq!(
        config.cluster.peers_dns,
        format!("agentenv-peers.{ns}.svc.cluster.local:{port}")
    );
    for svc in [peers, find(&docs, "Service", "agentenv")] {
        assert_eq!(&svc["spec"]["selector"], labels, "{svc}");
        assert_eq!(svc["metadata"]["namespace"], ns);
        assert_eq!(svc["spec"]["ports"][0]["targetPort"], "api");
    }
    find(&docs, "Namespace", ns);
}

fn haproxy_check(config: &Path, env: &[(String, String)]) {
    let out = Command::new("haproxy")
        .args(["-c", "-f"])
        .arg(config)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("haproxy: run scripts/setup.sh");
    assert!(
        out.status.success(),
        "haproxy -c -f {}: {}{}",
        config.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_haproxy_configs_check() {
    // deploy/haproxy/haproxy.cfg with the environment the cluster test runs it with: it
    // names exactly those variables.
    let file = Path::new(ROOT).join("deploy/haproxy/haproxy.cfg");
    let text = std::fs::read_to_string(&file).unwrap();
    let mut named: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.split("${").skip(1))
        .map(|rest| rest.split('}').next().unwrap())
        .collect();
    named.sort();
    named.dedup();
    let env = common::cluster::haproxy_env();
    let mut set: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
    set.sort();
    assert_eq!(named, set);
    haproxy_check(&file, &env);
    // The Kubernetes example's, as its ConfigMap holds it.
    let docs = documents();
    let cm = find(&docs, "ConfigMap", "agentenv-haproxy");
    let dir = std::env::temp_dir().join(format!("aenv-deploy-lb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("haproxy.cfg");
    std::fs::write(&cfg, cm["data"]["haproxy.cfg"].as_str().unwrap()).unwrap();
    haproxy_check(&cfg, &[]);
    let deployment = find(&docs, "Deployment", "agentenv-haproxy");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert!(container["args"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a == "/usr/local/etc/haproxy/haproxy.cfg"));
    std::fs::remove_dir_all(&dir).unwrap();
}
