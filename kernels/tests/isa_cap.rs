//! `FISSION_MAX_ISA` caps the kernels' instruction set for a whole process. The cap is read
//! once per process, so each case runs this test binary again as a child with the variable set.

use std::process::Command;

const CHILD: &str = "FISSION_ISA_CAP_CHILD";

#[test]
fn max_isa_caps_the_kernels_of_a_process() {
    if std::env::var_os(CHILD).is_some() {
        // In the child: report what the kernels picked under the parent's cap.
        println!("picked: {}", kernels::kernel_isa());
        return;
    }
    let mut cases = vec![("portable", "portable (int8: portable)".to_string())];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        cases.push(("avx2", "avx2 (int8: avx2)".to_string()));
    }
    if std::env::var_os("FISSION_MAX_ISA").is_none() {
        // An unknown name caps nothing: the child picks what this uncapped process picked.
        cases.push(("no-such-isa", kernels::kernel_isa()));
    }
    for (cap, want) in cases {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "max_isa_caps_the_kernels_of_a_process",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .env("FISSION_MAX_ISA", cap)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "child under {cap} failed: {stdout}");
        assert!(
            stdout.contains(&format!("picked: {want}\n")),
            "under {cap}: {stdout}"
        );
    }
}
