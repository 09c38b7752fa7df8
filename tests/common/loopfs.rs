//! A small loop-mounted ext4 filesystem for tests that fill the state disk.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// An ext4 filesystem in a sparse image file, loop-mounted at `dir` for one test; always
/// unmounted (which detaches its loop device) on drop, also when the test panics. Mounted at a server's
/// `<scratch>/state`, it also removes that scratch dir after a passing test, as the
/// [`super::Server`] does (which cannot while the filesystem is mounted in it).
pub struct LoopFs {
    image: PathBuf,
    device: String,
    dir: PathBuf,
}

impl LoopFs {
    pub fn new(dir: &Path, size_mb: u64) -> LoopFs {
        let image = std::env::temp_dir().join(format!(
            "aenv-loopfs-{}-{}.img",
            std::process::id(),
            dir.file_name().unwrap().to_string_lossy()
        ));
        std::fs::File::create(&image)
            .unwrap()
            .set_len(size_mb << 20)
            .unwrap();
        run(
            "mkfs.ext4",
            &["-q", "-F", "-m", "0", image.to_str().unwrap()],
        );
        let device = run("losetup", &["--find", "--show", image.to_str().unwrap()])
            .trim()
            .to_string();
        let fs = LoopFs {
            image,
            device,
            dir: dir.to_path_buf(),
        };
        std::fs::create_dir_all(dir).unwrap();
        run("mount", &[&fs.device, dir.to_str().unwrap()]);
        // Detaching a mounted device makes the kernel detach it once it is unmounted
        // (autoclear): a test killed before its drop leaves no loop device behind once its
        // mount is gone (with its mount namespace, under scripts/run-tests).
        run("losetup", &["-d", &fs.device]);
        fs
    }

    /// Free bytes now (as the server sees them).
    pub fn free(&self) -> u64 {
        let out = run("df", &["-B1", "--output=avail", self.dir.to_str().unwrap()]);
        out.lines().nth(1).unwrap().trim().parse().unwrap()
    }

    /// Fills the filesystem with `<dir>/filler-N`, one fallocate, until about `leave`
    /// bytes are free (a little less: the file's extent blocks come out of them too).
    pub fn fill_about(&self, leave: u64, n: u32) -> PathBuf {
        let path = self.dir.join(format!("filler-{n}"));
        let bulk = self.free().saturating_sub(leave);
        run(
            "fallocate",
            &["-l", &bulk.to_string(), path.to_str().unwrap()],
        );
        path
    }

    /// Fills the filesystem with `<dir>/filler-N` until `leave` bytes are free (or none
    /// are left): fallocate for the bulk, written blocks for the rest.
    pub fn fill_to(&self, leave: u64, n: u32) -> PathBuf {
        let path = self.dir.join(format!("filler-{n}"));
        let mut f = std::fs::File::create(&path).unwrap();
        let mut len = 0u64;
        // fallocate takes extent blocks of its own out of the free space too: it is asked
        // for a little less than what is over, again, until less than 1 MiB is; written
        // blocks (each synced, so the free space counts them) take the rest. A few
        // allocations, not one fsync per 64 KiB of everything (slow on a busy host disk).
        let block = vec![0u8; 64 << 10];
        loop {
            let over = self.free().saturating_sub(leave);
            if over == 0 {
                break;
            }
            if over > 1 << 20 {
                let more = over - over / 64 - (256 << 10);
                run(
                    "fallocate",
                    &[
                        "-o",
                        &len.to_string(),
                        "-l",
                        &more.to_string(),
                        path.to_str().unwrap(),
                    ],
                );
                len += more;
                continue;
            }
            let n = (over as usize).min(block.len());
            use std::io::{Seek, SeekFrom, Write};
            let wrote = f
                .seek(SeekFrom::Start(len))
                .and_then(|_| f.write_all(&block[..n]))
                .and_then(|()| f.sync_all());
            if wrote.is_err() {
                break;
            }
            len += n as u64;
        }
        path
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let dir = self.dir.to_str().unwrap();
        let unmounted = (0..50).any(|_| {
            let ok = Command::new("umount")
                .arg(dir)
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                std::thread::sleep(Duration::from_millis(200));
            }
            ok
        });
        if !unmounted {
            let _ = Command::new("umount").args(["-l", dir]).status();
        }
        // No `losetup -d`: the device went with the unmount (autoclear, see `new`), and
        // its number may already be another test's.
        let _ = std::fs::remove_file(&self.image);
        let _ = std::fs::remove_dir(&self.dir);
        let scratch = self.dir.parent().filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("aenv-e2e-"))
        });
        if let (Some(scratch), false) = (scratch, std::thread::panicking()) {
            let _ = std::fs::remove_dir_all(scratch);
        }
    }
}

/// Runs a host tool with an argument vector; asserts it succeeded, returns its stdout.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
