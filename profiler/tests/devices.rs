//! Device discovery and selection against recorded topologies, and `migprof devices` as users see it.

use std::path::PathBuf;
use std::process::Command;

use migprof::gpu::{select, Topology, TOPOLOGY_ENV};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/topologies")
        .join(name)
}

fn topology(name: &str) -> Topology {
    Topology::read(&fixture(name)).unwrap()
}

#[test]
fn whole_gpus_by_index_uuid_and_prefix() {
    let t = topology("no_mig.json");
    let s = select(&t, "1").unwrap();
    assert_eq!((s.gpu.index, s.mig.is_none()), (1, true));
    assert_eq!(s.uuid(), "GPU-1d0f3a52-8c2e-4b7a-9f61-2a9c4e7b1002");
    assert_eq!(select(&t, "first").unwrap().gpu.index, 0);
    assert_eq!(
        select(&t, "GPU-1d0f3a52-8c2e-4b7a-9f61-2a9c4e7b1001")
            .unwrap()
            .gpu
            .index,
        0
    );
    let err = select(&t, "GPU-1d0f3a52").unwrap_err().to_string();
    assert!(err.contains("matches 2 devices"), "{err}");
    let err = select(&t, "7").unwrap_err().to_string();
    assert!(
        err.contains("no GPU 7") && err.contains("GPU-1d0f3a52-8c2e-4b7a-9f61-2a9c4e7b1002"),
        "{err}"
    );
}

#[test]
fn seven_1g_slices_with_two_digit_gpu_instance_ids() {
    let t = topology("a100_7x1g.json");
    let m = &t.gpus[0].mig_devices[4];
    assert_eq!((m.gpu_instance_id, m.profile.as_str()), (11, "1g.5gb"));
    let s = select(&t, &m.uuid).unwrap();
    assert_eq!(s.mig.as_ref().unwrap().gpu_instance_id, 11);
    assert_eq!(s.uuid(), m.uuid);
    // A GPU with MIG on cannot run CUDA work itself.
    let err = select(&t, "0").unwrap_err().to_string();
    assert!(err.contains("MIG on") && err.contains(&m.uuid), "{err}");
}

#[test]
fn mixed_slices_and_media_extension_profiles() {
    let t = topology("h100_3g_2g_1g_1g.json");
    let profiles: Vec<&str> = t.gpus[0].mig_devices.iter().map(|m| m.profile.as_str()).collect();
    assert_eq!(profiles, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb+me"]);
    let me = select(&t, "MIG-0a1b2c3d-0004").unwrap();
    assert_eq!(me.mig.unwrap().profile, "1g.10gb+me");
    // The second GPU, MIG off, is usable whole.
    assert_eq!(
        select(&t, "1").unwrap().gpu.uuid,
        "GPU-9e4c2b71-5d3a-4c1f-8e20-6b7d9a3f1111"
    );
    let err = select(&t, "MIG-0a1b2c3d").unwrap_err().to_string();
    assert!(err.contains("matches 4 devices"), "{err}");
}

#[test]
fn a_profile_name_selects_the_only_slice_of_that_profile() {
    let t = topology("h100_3g_2g_1g_1g.json");
    let s = select(&t, "3g.40gb").unwrap();
    assert_eq!(s.uuid(), "MIG-0a1b2c3d-0001-5e6f-8a9b-0c1d2e3f4a01");
    assert_eq!(select(&t, "1g.10gb+me").unwrap().mig.unwrap().gpu_instance_id, 10);
    let err = select(&t, "4g.40gb").unwrap_err().to_string();
    assert!(
        err.contains("no MIG device has the profile `4g.40gb`") && err.contains("MIG-0a1b2c3d-0003"),
        "{err}"
    );
    let t = topology("a100_7x1g.json");
    let err = select(&t, "1g.5gb").unwrap_err().to_string();
    assert!(
        err.contains("7 MIG devices have the profile `1g.5gb`; name one by its MIG UUID"),
        "{err}"
    );
    let t = topology("h100_two_compute_instances.json");
    assert_eq!(select(&t, "1c.3g.40gb").unwrap().mig.unwrap().compute_instance_id, 0);
}

#[test]
fn two_compute_instances_share_one_gpu_instance() {
    let t = topology("h100_two_compute_instances.json");
    let second = select(&t, "MIG-7d6c5b4a-0002").unwrap().mig.unwrap();
    assert_eq!(
        (
            second.gpu_instance_id,
            second.compute_instance_id,
            second.profile.as_str()
        ),
        (1, 1, "2c.3g.40gb")
    );
}

#[test]
fn a_mig_uuid_that_does_not_exist_lists_the_devices() {
    let t = topology("h100_3g_2g_1g_1g.json");
    let err = select(&t, "MIG-ffffffff-0000-5000-8000-000000000000")
        .unwrap_err()
        .to_string();
    assert!(err.contains("no device has the UUID"), "{err}");
    for m in &t.gpus[0].mig_devices {
        assert!(err.contains(&m.uuid), "{err}");
    }
}

#[test]
fn json_round_trips() {
    for name in [
        "no_mig.json",
        "a100_7x1g.json",
        "h100_3g_2g_1g_1g.json",
        "h100_two_compute_instances.json",
    ] {
        let t = topology(name);
        assert_eq!(serde_json::from_str::<Topology>(&t.to_json()).unwrap(), t, "{name}");
    }
}

fn devices(args: &[&str], topology: Option<&str>) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_migprof"));
    cmd.arg("devices").args(args);
    match topology {
        Some(name) => cmd.env(TOPOLOGY_ENV, fixture(name)),
        None => cmd.env_remove(TOPOLOGY_ENV),
    };
    let o = cmd.output().unwrap();
    (
        o.status.code().unwrap(),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn devices_prints_the_tree() {
    let (code, out, _) = devices(&[], Some("h100_3g_2g_1g_1g.json"));
    assert_eq!(code, 0);
    assert!(
        out.contains("GPU 0: NVIDIA H100 80GB HBM3 (GPU-9e4c2b71-5d3a-4c1f-8e20-6b7d9a3f0000) 81559 MiB, MIG on"),
        "{out}"
    );
    assert!(
        out.contains(
            "├─ MIG 3g.40gb      GI  2 CI  0   60 SMs   40448 MiB  (MIG-0a1b2c3d-0001-5e6f-8a9b-0c1d2e3f4a01)"
        ),
        "{out}"
    );
    assert!(out.contains("└─ MIG 1g.10gb+me"), "{out}");
    assert!(
        out.contains("GPU 1: NVIDIA H100 80GB HBM3 (GPU-9e4c2b71-5d3a-4c1f-8e20-6b7d9a3f1111) 81559 MiB, MIG off"),
        "{out}"
    );
    let (_, out, _) = devices(&[], Some("no_mig.json"));
    assert!(out.contains("MIG off (pending on after reset)"), "{out}");
}

#[test]
fn devices_json_is_the_recording_format() {
    let (code, out, _) = devices(&["--json"], Some("a100_7x1g.json"));
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<Topology>(&out).unwrap(),
        topology("a100_7x1g.json")
    );
}

#[test]
fn devices_without_a_driver_says_so_and_exits_cleanly() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        return; // a machine with a driver: the GPU run covers it
    }
    let (code, out, err) = devices(&[], None);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("no NVIDIA GPU here") && out.contains("no usable NVIDIA driver"),
        "{out}"
    );
    assert!(out.contains("migprof runs on the CPU"), "{out}");
    // As JSON: still JSON, with no GPU and the reason.
    let (code, out, err) = devices(&["--json"], None);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["gpus"], serde_json::json!([]));
    assert!(
        v["reason"].as_str().unwrap().contains("no usable NVIDIA driver"),
        "{out}"
    );
}
