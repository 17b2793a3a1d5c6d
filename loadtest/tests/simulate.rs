//! `fission-loadtest simulate` as a user runs it: the binary, its flags and its outputs.

use std::process::Command;

fn simulate(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_fission-loadtest"))
        .arg("simulate")
        .args(args)
        .output()
        .expect("the binary runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn a_simulated_level_reports_like_a_real_one_and_repeats_exactly() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let json = |name: &str| dir.path().join(name).to_string_lossy().into_owned();
    let args = |path: &str| {
        vec![
            "--cluster".to_string(),
            "1P+2D".into(),
            "--rate".into(),
            "20".into(),
            "--duration".into(),
            "5s".into(),
            "--workload".into(),
            "sharegpt".into(),
            "--seed".into(),
            "3".into(),
            "--json".into(),
            path.to_string(),
        ]
    };
    let a = args(&json("a.json"));
    let b = args(&json("b.json"));
    let md = simulate(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        md.contains("## fission-loadtest simulate: 1P+2D (h100-llama8b)"),
        "{md}"
    );
    assert!(md.contains("| TTFT | TPOT |"), "{md}");
    simulate(&b.iter().map(String::as_str).collect::<Vec<_>>());
    let (ja, jb) = (
        std::fs::read_to_string(json("a.json")).expect("written"),
        std::fs::read_to_string(json("b.json")).expect("written"),
    );
    let v: serde_json::Value = serde_json::from_str(&ja).expect("json");
    let w: serde_json::Value = serde_json::from_str(&jb).expect("json");
    // Everything but where the JSON was written.
    assert_eq!(
        v["levels"], w["levels"],
        "a seeded simulation repeats exactly"
    );
    assert_eq!(v["simulated"], "1P+2D (h100-llama8b)");
    assert!(
        v["levels"][0]["summary"]["requests"]
            .as_u64()
            .expect("a count")
            > 50
    );
}

#[test]
fn a_plan_names_a_split_for_each_gpu_count() {
    let md = simulate(&[
        "plan",
        "--gpus",
        "4",
        "--workload",
        "fixed",
        "--input-len",
        "1024",
        "--output-len",
        "16",
        "--duration",
        "5s",
        "--slo-ttft-ms",
        "300",
        "--slo-tpot-ms",
        "50",
    ]);
    assert!(md.contains("| GPUs | best P:D |"), "{md}");
    assert!(md.lines().any(|l| l.starts_with("| 4 | ")), "{md}");
}

#[test]
fn bad_clusters_and_profiles_are_refused() {
    for args in [
        &["--cluster", "0P+1D", "--rate", "1"][..],
        &[
            "--cluster",
            "1P+1D",
            "--rate",
            "1",
            "--profile",
            "/nonexistent.json",
        ][..],
        &["--rate", "1"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_fission-loadtest"))
            .arg("simulate")
            .args(args)
            .output()
            .expect("the binary runs");
        assert!(!out.status.success(), "{args:?} was accepted");
    }
}

#[test]
fn calibration_times_the_engine_and_checks_the_profile_on_mixed_steps() {
    let model = testkit::fission::stories_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_fission-loadtest"))
        .args(["simulate", "calibrate", "--model"])
        .arg(&model)
        .args([
            "--prefill",
            "8,32,64",
            "--batch",
            "1,2,4",
            "--context",
            "16,32",
        ])
        .args(["--steps", "2", "--repeats", "1", "--kv-blocks", "64"])
        .args([
            "--mixed-prompt",
            "16,32",
            "--mixed-batch",
            "2",
            "--mixed-context",
            "16",
        ])
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Both mixed steps were timed as mixed (calibration fails on a step the engine split).
    assert!(
        stderr.contains("mixed steps (2 timed, not fitted)"),
        "{stderr}"
    );
    let profile: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON profile");
    assert_eq!(profile["step"]["kind"], "linear");
    assert_eq!(profile["node"]["kv_blocks"], 64);
    assert!(
        profile["sources"]["step"]
            .as_str()
            .is_some_and(|s| s.contains("on 2 mixed prefill+decode steps")),
        "{}",
        profile["sources"]
    );
}

#[test]
fn calibration_measures_the_link_and_its_push_beside_prefill_steps() {
    let model = testkit::fission::stories_dir();
    for transport in ["quic", "tcp"] {
        let out = Command::new(env!("CARGO_BIN_EXE_fission-loadtest"))
            .args(["simulate", "calibrate", "--model"])
            .arg(&model)
            .args(["--prefill", "32,64", "--batch", "1", "--context", "16"])
            .args(["--steps", "1", "--repeats", "1", "--kv-blocks", "64"])
            .args(["--mixed-prompt", "16", "--mixed-batch", "1"])
            .args(["--mixed-context", "16", "--measure-link", transport])
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        // Both prompt lengths were timed alone and pushing.
        for len in ["| 32 |", "| 64 |"] {
            assert!(stderr.contains(len), "{stderr}");
        }
        let profile: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("a JSON profile");
        let link = &profile["link"];
        let bandwidth = link["bandwidth_bytes_per_s"].as_f64().expect("a bandwidth");
        // Measured, not the 1 GB/s given by default.
        assert!(bandwidth > 0.0 && bandwidth != 1e9, "{link}");
        assert!(link["push_step_s_per_byte"].as_f64().expect("a price") >= 0.0);
        let source = profile["sources"]["link"].as_str().expect("a source");
        assert!(
            source.contains(&format!("--measure-link {transport}")),
            "{source}"
        );
    }
}
