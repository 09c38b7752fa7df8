//! A build's COPY files: the SDKs upload a tar (gzipped by default) per files hash
//! (`GET /templates/{id}/files/{hash}`, then `PUT` to the link it gives). The upload is
//! bounded (`[templates] max_upload_bytes`, else 413) and applied with the image layer
//! rules (`image::unpack`: nothing escapes, no setuid bits or device nodes on the host,
//! byte and inode budgets; a hostile entry is a 400 naming it) into a staging tree, which
//! is packed again and kept as `<state_dir>/template-files/<hash>/files.tar`. A COPY
//! step writes that tar into the build VM with the guest agent and unpacks it there as
//! root, placing it at the destination with the owner and mode the SDK asked for.

use super::build_steps::{CopyFiles, StepRunner};
use super::steps::StepKind;
use crate::agent::AgentClient;
use crate::image::unpack::{Budget, Unpacker};
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Inodes an upload may create.
const MAX_INODES: u64 = 1_000_000;

/// Why an upload was refused.
#[derive(Debug, Clone)]
pub enum UploadError {
    /// Over `[templates] max_upload_bytes` (413).
    TooLarge(u64),
    /// Not a tar, or an entry the layer rules refuse (400).
    Refused(String),
    /// The server's own disk failed (500).
    Io(String),
}

impl std::fmt::Display for UploadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UploadError::TooLarge(n) => write!(
                f,
                "the upload exceeds {n} bytes ([templates] max_upload_bytes)"
            ),
            UploadError::Refused(m) => write!(f, "the upload was refused: {m}"),
            UploadError::Io(m) => write!(f, "cannot store the upload: {m}"),
        }
    }
}

/// The uploaded files, by hash.
pub(crate) struct Uploads {
    dir: PathBuf,
    max_bytes: u64,
    /// The key upload links are signed with: the same on every node of a cluster (it
    /// follows from the shared API key), so a link one node gave is good on any node
    /// behind the load balancer (docs/cluster.md, "Templates on every node").
    link_key: [u8; 32],
}

/// How long an upload link is good.
const LINK_LIFETIME: Duration = Duration::from_secs(3600);

/// A staging directory, removed on drop.
struct Staging(PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The key of upload links: derived from the API key when there is one (every node of a
/// cluster has the same), else fresh for this process.
pub(crate) fn link_key(api_key: Option<&str>) -> [u8; 32] {
    use sha2::Digest;
    match api_key {
        Some(key) => sha2::Sha256::new()
            .chain_update(b"agentenv upload links\0")
            .chain_update(key.as_bytes())
            .finalize()
            .into(),
        None => {
            let mut bytes = [0u8; 32];
            crate::sys::fs::random_bytes(&mut bytes).expect("getrandom(2) failed");
            bytes
        }
    }
}

impl Uploads {
    pub fn new(dir: PathBuf, max_bytes: u64, link_key: [u8; 32]) -> Uploads {
        // Leftovers of uploads a crash interrupted.
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(".incoming-") {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        Uploads {
            dir,
            max_bytes,
            link_key,
        }
    }

    fn mac(&self, hash: &str, until: u64) -> String {
        let message = format!("{hash}.{until}");
        crate::util::hex(&crate::util::hmac_sha256(
            &self.link_key,
            message.as_bytes(),
        ))
    }

    /// A token for an upload link of `hash` (the SDKs upload without the API key, as to
    /// a presigned URL): `<until>.<HMAC of hash and until>`, good for [`LINK_LIFETIME`].
    pub fn grant(&self, hash: &str) -> String {
        let until = crate::util::unix_secs() + LINK_LIFETIME.as_secs();
        format!("{until}.{}", self.mac(hash, until))
    }

    /// Whether `token` is a live token of `hash`'s link.
    pub fn check(&self, hash: &str, token: &str) -> bool {
        let Some((until, mac)) = token.split_once('.') else {
            return false;
        };
        let Ok(until) = until.parse::<u64>() else {
            return false;
        };
        until > crate::util::unix_secs()
            && crate::util::constant_time_eq(self.mac(hash, until).as_bytes(), mac.as_bytes())
    }

    pub fn tar_path(&self, hash: &str) -> PathBuf {
        self.dir.join(hash).join("files.tar")
    }

    pub fn present(&self, hash: &str) -> bool {
        self.tar_path(hash).is_file()
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Takes an upload for `hash`: bounded, checked with the layer rules, stored.
    pub fn receive(&self, hash: &str, body: &mut dyn Read) -> Result<(), UploadError> {
        let io = |e: io::Error| UploadError::Io(e.to_string());
        crate::store::ensure_private_dir(&self.dir).map_err(|e| UploadError::Io(e.to_string()))?;
        let staging = Staging(
            self.dir
                .join(format!(".incoming-{}", crate::util::new_id())),
        );
        std::fs::create_dir(&staging.0).map_err(io)?;
        let raw = staging.0.join("upload");
        let mut out = File::create(&raw).map_err(io)?;
        let n = io::copy(&mut body.take(self.max_bytes + 1), &mut out).map_err(io)?;
        if n > self.max_bytes {
            return Err(UploadError::TooLarge(self.max_bytes));
        }
        drop(out);
        let tree = staging.0.join("tree");
        std::fs::create_dir(&tree).map_err(io)?;
        unpack(&raw, &tree, self.max_bytes)?;
        let packed = staging.0.join("files.tar");
        pack(&tree, &packed).map_err(io)?;
        let dest = self.dir.join(hash);
        let _ = std::fs::create_dir(&dest);
        std::fs::rename(&packed, dest.join("files.tar")).map_err(io)?;
        Ok(())
    }
}

/// Applies the (maybe gzipped) tar at `raw` onto `tree` with the layer rules.
fn unpack(raw: &Path, tree: &Path, max_bytes: u64) -> Result<(), UploadError> {
    let mut file = BufReader::new(File::open(raw).map_err(|e| UploadError::Io(e.to_string()))?);
    let gzipped = std::io::BufRead::fill_buf(&mut file)
        .map_err(|e| UploadError::Io(e.to_string()))?
        .starts_with(&[0x1f, 0x8b]);
    let budget = Budget {
        // Unpacked data may be larger than the (compressed) upload; 4x bounds it.
        bytes: max_bytes.saturating_mul(4),
        inodes: MAX_INODES,
        disk_mb: (max_bytes.saturating_mul(4) >> 20).min(u32::MAX as u64) as u32,
    };
    let refused = |e: crate::image::ImageError| UploadError::Refused(e.to_string());
    let mut unpacker = Unpacker::new(tree, budget).map_err(refused)?;
    if gzipped {
        unpacker
            .apply_layer(flate2::read::GzDecoder::new(file), "the upload")
            .map_err(refused)?;
    } else {
        unpacker.apply_layer(file, "the upload").map_err(refused)?;
    }
    let fixups = unpacker.finish().map_err(refused)?;
    // Device nodes and setuid bits would be restored in the guest from these: an upload
    // gets neither.
    if let Some(f) = fixups.first() {
        return Err(UploadError::Refused(format!(
            "entry {}: {} is not allowed in an upload",
            f.path.trim_start_matches('/'),
            if f.device.is_some() {
                "a device node"
            } else {
                "a setuid/setgid file or file capability"
            }
        )));
    }
    Ok(())
}

/// Packs the checked tree again (symlinks as symlinks).
fn pack(tree: &Path, out: &Path) -> io::Result<()> {
    let mut b = tar::Builder::new(File::create(out)?);
    b.follow_symlinks(false);
    b.append_dir_all(".", tree)?;
    b.into_inner()?.sync_all()
}

/// Unpacks `$1` (the tar) as root and places `$2` (relative to the context, a glob) at
/// `$3`, owned by `$4` with mode `$5` (when not empty): a directory's contents go into
/// the destination, a file goes into it when it ends with `/` or is a directory.
const COPY_SCRIPT: &str = r#"set -e
t=$(mktemp -d /tmp/.agentenv-copy.XXXXXX)
trap 'rm -rf "$t"; rm -f "$1"' EXIT
tar -xf "$1" -C "$t"
owner=$4; u=${owner%%:*}
if ! id "$u" >/dev/null 2>&1; then
  if [ "$u" = user ]; then owner=root; u=root; else echo "no user $u in the image" >&2; exit 1; fi
fi
dest=$3
case "$dest" in
  /*) ;;
  *) home=$(awk -F: -v u="$u" '$1==u{print $6}' /etc/passwd); dest="${home:-/}/$dest" ;;
esac
cd "$t"
found=
for s in $2; do
  [ -e "$s" ] || [ -L "$s" ] || continue
  found=1
  chown -R -h "$owner" "$s"
  [ -z "$5" ] || chmod -R "$5" "$s"
  if [ -d "$s" ] && [ ! -L "$s" ]; then
    [ -d "$dest" ] || { mkdir -p "$dest"; chown "$owner" "$dest"; }
    cp -a "$s"/. "$dest"/
  else
    case "$dest" in
      */) mkdir -p "$dest"; cp -a "$s" "$dest" ;;
      *) if [ -d "$dest" ]; then cp -a "$s" "$dest"/; else mkdir -p "$(dirname "$dest")"; cp -a "$s" "$dest"; fi ;;
    esac
  fi
done
[ -n "$found" ] || { echo "nothing in the upload matches $2" >&2; exit 1; }
"#;

/// COPY steps from the uploads, through the build VM's agent.
pub(crate) struct UploadedFiles<'a> {
    pub store: &'a Uploads,
    pub agent: &'a AgentClient,
}

impl CopyFiles for UploadedFiles<'_> {
    fn copy(&self, runner: &StepRunner, step: &str, kind: &StepKind) -> Result<(), String> {
        let StepKind::Copy {
            src,
            dest,
            user,
            mode,
            files_hash,
        } = kind
        else {
            return Err("not a COPY step".into());
        };
        let tar = self.store.tar_path(files_hash);
        let mut file = File::open(&tar).map_err(|_| {
            format!(
                "the files of hash {files_hash} were not uploaded (GET /templates/{{id}}/files/{{hash}}, then PUT to its url)"
            )
        })?;
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        let guest_tar = format!("/tmp/.agentenv-copy-{files_hash}.tar");
        self.agent
            .write_file(&guest_tar, len, &mut file)
            .map_err(|e| format!("cannot write the files into the build VM: {e}"))?;
        let owner = user
            .clone()
            .unwrap_or_else(|| runner.state.user().to_string());
        let mode = mode.map(|m| format!("{m:o}")).unwrap_or_default();
        let dest = runner.state.resolve(dest);
        runner.shell(
            step,
            "root",
            COPY_SCRIPT,
            &[&guest_tar, src, &dest, &owner, &mode],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uploads() -> (Uploads, PathBuf) {
        let dir = std::env::temp_dir().join(format!("aenv-uploads-{}", crate::util::new_id()));
        (Uploads::new(dir.clone(), 1 << 20, link_key(None)), dir)
    }

    fn tar_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            h.set_entry_type(tar::EntryType::Regular);
            // set_path refuses `..`; write the raw name as a hostile client would.
            h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn upload_links_are_good_on_every_node_with_the_same_key() {
        let dir = std::env::temp_dir();
        let key = link_key(Some("k".repeat(32).as_str()));
        let (here, there) = (
            Uploads::new(dir.clone(), 1, key),
            Uploads::new(dir.clone(), 1, key),
        );
        let hash = "a".repeat(64);
        let token = here.grant(&hash);
        assert!(here.check(&hash, &token) && there.check(&hash, &token));
        assert!(!there.check(&"b".repeat(64), &token), "another hash");
        let other = Uploads::new(dir, 1, link_key(Some("o".repeat(32).as_str())));
        assert!(!other.check(&hash, &token), "another API key");
        let (_, mac) = token.split_once('.').unwrap();
        assert!(!here.check(&hash, &format!("1.{mac}")), "expired");
        assert!(!here.check(&hash, "garbage"));
    }

    #[test]
    fn a_good_upload_is_kept_gzipped_or_not() {
        let (u, dir) = uploads();
        let tar = tar_of(&[("app/a.txt", b"hello")]);
        u.receive(&"a".repeat(64), &mut &tar[..]).unwrap();
        assert!(u.present(&"a".repeat(64)));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).unwrap();
        let gz = gz.finish().unwrap();
        u.receive(&"b".repeat(64), &mut &gz[..]).unwrap();
        let mut names = Vec::new();
        let mut a = tar::Archive::new(File::open(u.tar_path(&"b".repeat(64))).unwrap());
        for e in a.entries().unwrap() {
            names.push(e.unwrap().path().unwrap().display().to_string());
        }
        assert!(names.iter().any(|n| n.ends_with("app/a.txt")), "{names:?}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn hostile_and_oversize_uploads_are_refused_and_leave_nothing() {
        let (u, dir) = uploads();
        let evil = tar_of(&[("../../etc/evil", b"x")]);
        let e = u.receive(&"c".repeat(64), &mut &evil[..]).unwrap_err();
        assert!(
            matches!(e, UploadError::Refused(ref m) if m.contains("evil")),
            "{e}"
        );
        let big = vec![0u8; (1 << 20) + 10];
        assert!(matches!(
            u.receive(&"d".repeat(64), &mut &big[..]).unwrap_err(),
            UploadError::TooLarge(_)
        ));
        let junk = b"not a tar at all, definitely not".repeat(40);
        assert!(matches!(
            u.receive(&"e".repeat(64), &mut &junk[..]).unwrap_err(),
            UploadError::Refused(_)
        ));
        assert!(!u.present(&"c".repeat(64)));
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert!(left.is_empty(), "{left:?}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
