//! End-to-end: admission by the host's real memory headroom (issue 21, item 3). A server
//! whose reserve leaves ~500 MiB of this host's MemAvailable admits sandboxes while their
//! guests fill memory, and refuses the next create with a 429 naming MemAvailable before
//! the host gets anywhere near running out; nominal sizes and vCPUs are no limit by default.
//! And with the default standby pool: once the host's headroom falls below the reserve
//! (this test holds memory itself), a create that would claim a waiting standby and a
//! resume are refused alike, counted in /metrics, and both work again once it is back.

mod common;

use common::*;
use serde_json::json;

/// `MemAvailable` of this host, MiB.
fn available_mb() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").expect("read /proc/meminfo");
    let line = text
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .expect("MemAvailable in /proc/meminfo");
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        >> 10
}

/// `MemAvailable` once it has stopped moving (an earlier test's VMs and memory may still
/// be going back to the host): two readings a second apart within 16 MiB, at most 30 s.
fn settled_available_mb() -> u64 {
    let mut last = available_mb();
    for _ in 0..30 {
        std::thread::sleep(std::time::Duration::from_secs(1));
        let now = available_mb();
        if now.abs_diff(last) <= 16 {
            return now;
        }
        last = now;
    }
    last
}

/// The MiB a host-memory refusal counts for VMs still starting.
fn settling_mb(refusal: &serde_json::Value) -> u64 {
    let message = refusal["message"].as_str().unwrap_or_default();
    message
        .split(" MiB by VMs still starting")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no VMs-still-starting figure: {refusal}"))
}

/// What each admitted guest puts in its RAM (a tmpfs file), MiB.
const FILL_MB: u64 = 100;
/// Creates tried at most.
const MAX_CREATES: usize = 12;

#[test]
fn creates_are_refused_while_the_host_still_has_its_reserve() {
    let _serial = serial();
    let headroom = 500;
    let reserve = settled_available_mb()
        .checked_sub(headroom)
        .expect("this test needs more than 500 MiB of MemAvailable");
    let s = Server::start(&format!(
        "[admission]\nreserved_memory_mb = {reserve}\nvm_startup_mb = 64\n\
         [templates]\nstandby_per_template = 0\n"
    ));
    build_template(&s, "base");
    let mut admitted = Vec::new();
    let mut lowest = u64::MAX;
    let mut refusal = None;
    for _ in 0..MAX_CREATES {
        let before = available_mb();
        let (code, v) = s.call("POST", "/sandboxes", Some(json!({"templateID": "base"})));
        if code == 429 {
            // Refused for the reserve + vm_startup_mb + what VMs still starting will touch
            // (64 MiB each, named in the message), not for anything else.
            let settling = settling_mb(&v);
            assert!(
                before < reserve + 64 + settling + 32,
                "{before} MiB free: {v}"
            );
            refusal = Some(v);
            break;
        }
        assert_eq!(code, 201, "{v}\n{}", s.log());
        assert!(before + 32 >= reserve + 64, "{before} MiB free, admitted");
        let id = id_of(&v);
        sh(
            &s,
            &id,
            &format!("dd if=/dev/zero of=/dev/shm/fill bs=1M count={FILL_MB}"),
        );
        admitted.push(id);
        lowest = lowest.min(available_mb());
    }
    let refusal = refusal.unwrap_or_else(|| {
        panic!(
            "{MAX_CREATES} guests holding {FILL_MB} MiB each were admitted within {headroom} MiB"
        )
    });
    let message = refusal["message"].as_str().unwrap();
    assert!(
        message.contains("MemAvailable") && message.contains("reserved_memory_mb"),
        "{refusal}"
    );
    assert!(!admitted.is_empty(), "the first create fits: {refusal}");
    // 256 MiB sandboxes, 1 vCPU each: by nominal sums nothing would have been refused;
    // the refusal came from the guests' real memory (checked against MemAvailable above,
    // since other processes' memory may move while this runs).
    // Each start was admitted with the reserve + 64 MiB free; its guest then took at
    // most its 256 MiB (and QEMU's own few MiB), so the host kept most of the reserve.
    assert!(
        lowest + 320 >= reserve,
        "MemAvailable fell to {lowest} MiB, reserve {reserve}"
    );
    let metrics = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(
        metrics.contains(&format!(
            "agentenv_host_memory_mb{{state=\"reserve\"}} {reserve}"
        )),
        "{metrics}"
    );
    for id in &admitted {
        assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    }
    // Room again once they are gone (their memory back to the host, and the last
    // refused start settled).
    let freed = wait_until(std::time::Duration::from_secs(30), || {
        available_mb() >= reserve + 3 * 64
    });
    assert!(
        freed,
        "MemAvailable {} MiB after the deletes, reserve {reserve}",
        available_mb()
    );
    wait_for_room(&s);
    let (code, v) = s.call("POST", "/sandboxes", Some(json!({"templateID": "base"})));
    assert_eq!(code, 201, "{v}");
    assert_eq!(
        s.call("DELETE", &format!("/sandboxes/{}", id_of(&v)), None)
            .0,
        204
    );
}

fn metrics(s: &Server) -> String {
    ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap()
}

/// A 429 that names the host's memory, the reserve and what to do.
fn assert_host_memory_refusal(code: u16, v: &serde_json::Value, what: &str) {
    assert_eq!(code, 429, "{what}: {v}");
    let message = v["message"].as_str().unwrap();
    assert!(
        message.contains("MemAvailable")
            && message.contains("reserved_memory_mb")
            && message.contains("pause or delete a sandbox"),
        "{what}: {v}"
    );
}

/// The server's own figure of the memory another VM may take (`agentenv_free_memory_mb`:
/// MemAvailable less the reserve and what VMs still starting will touch).
fn free_memory_mb(s: &Server) -> u64 {
    metric(s, "agentenv_free_memory_mb ")
}

/// Waits (up to 60 s) until the server would admit a start: no standby being made
/// (the pool holds its target) and room for one more VM's startup memory by its own
/// figure. What it waits on is the event the admission decides by, not a time.
fn wait_for_room(s: &Server) {
    let settled = wait_until(std::time::Duration::from_secs(60), || {
        let m = metrics(s);
        let ready = metric_in(&m, "agentenv_standby_vms{state=\"ready\"} ");
        let target = metric_in(&m, "agentenv_standby_vms{state=\"target\"} ");
        ready == target && metric_in(&m, "agentenv_free_memory_mb ") >= 64
    });
    assert!(
        settled,
        "no room for a start within 60 s: {} MiB free for VMs, MemAvailable {} MiB:\n{}",
        free_memory_mb(s),
        available_mb(),
        metrics(s)
    );
}

fn metric_in(text: &str, sample: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

#[test]
fn a_standby_claim_and_a_resume_are_refused_below_the_reserve() {
    let _serial = serial();
    // The reserve leaves 4000 MiB of today's MemAvailable: room for the template build,
    // the first sandbox and the standby and, after them, for the resume and the create at
    // the end. The memory this test then holds is measured against what the host has at
    // that moment, so it always ends up 300 MiB below the reserve.
    let headroom = 4000;
    let reserve = settled_available_mb()
        .checked_sub(headroom)
        .expect("this test needs more than 4000 MiB of MemAvailable");
    let s = Server::start(&format!(
        "[admission]\nreserved_memory_mb = {reserve}\nvm_startup_mb = 64\n"
    ));
    build_template(&s, "base");
    let (code, v) = s.call("POST", "/sandboxes", Some(json!({"templateID": "base"})));
    assert_eq!(code, 201, "{v}\n{}", s.log());
    let paused = id_of(&v);
    let (code, v) = s.call("POST", &format!("/sandboxes/{paused}/pause"), None);
    assert_eq!(code, 204, "{v}");
    let ready = wait_until(std::time::Duration::from_secs(60), || {
        metrics(&s).contains("agentenv_standby_vms{state=\"ready\"} 1")
    });
    assert!(ready, "no standby waiting:\n{}", s.log());
    let now = available_mb();
    let hog_mb = (now + 300).saturating_sub(reserve) as usize;
    let mut hog = vec![0u8; hog_mb << 20];
    // Touch every page: untouched pages of a zeroed allocation take no memory.
    for page in hog.chunks_mut(4096) {
        page[0] = 1;
    }
    std::hint::black_box(&hog);
    assert!(
        available_mb() < reserve,
        "{} MiB available holding {hog_mb} MiB (was {now}), reserve {reserve}",
        available_mb()
    );
    let (code, v) = s.call("POST", "/sandboxes", Some(json!({"templateID": "base"})));
    assert_host_memory_refusal(code, &v, "a create that claims the standby");
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{paused}/connect"),
        Some(json!({"timeout": 300})),
    );
    assert_host_memory_refusal(code, &v, "a resume");
    let (_, v) = s.call("GET", &format!("/sandboxes/{paused}"), None);
    assert_eq!(v["state"], "paused", "{v}");
    let m = metrics(&s);
    let refused = m
        .lines()
        .find_map(|l| l.strip_prefix("agentenv_admission_refusals_total{reason=\"host_memory\"} "))
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no refusal counter:\n{m}"));
    assert!(refused >= 2, "{refused} refusals counted");
    assert!(
        m.contains("agentenv_host_memory_pressure_pct{state=\"limit\"} 20"),
        "{m}"
    );
    drop(hog);
    // Once the server's own figure says a VM fits, the resume and then the create are
    // admitted at the first try.
    wait_for_room(&s);
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{paused}/connect"),
        Some(json!({"timeout": 300})),
    );
    assert!(
        code == 200 || code == 201,
        "the resume once there is room: {code} {v}"
    );
    wait_for_room(&s);
    let (code, v) = s.call("POST", "/sandboxes", Some(json!({"templateID": "base"})));
    assert_eq!(code, 201, "a create once there is room: {v}");
    for id in [paused, id_of(&v)] {
        assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    }
}
