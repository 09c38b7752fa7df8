//! One user id per QEMU process. Each QEMU runs as a uid of its own, taken from the
//! subordinate uid range of the VM account ([`super::qemu::VM_USER`]) in `/etc/subuid`
//! (reserved by `scripts/setup.sh` and `packaging/install.sh` with `usermod
//! --add-subuids`): a QEMU taken over by its guest shares its uid with no other QEMU, so it
//! cannot signal or `ptrace` one. The primary group stays the account's (template RAM
//! files are readable by that group). Without a range every QEMU runs as the account
//! itself, as before (logged once).

use parking_lot::Mutex;

/// Where the subordinate uid ranges are (shadow's format: `name:first:count` per line).
const SUBUID_FILE: &str = "/etc/subuid";
/// At most this many uids of the range are used (QEMUs alive at once).
const MAX_UIDS: u32 = 65536;

/// The first subordinate uid range of `user` (or of its uid) in `subuid` text.
fn range_of(subuid: &str, user: &str, uid: u32) -> Option<(u32, u32)> {
    subuid.lines().find_map(|line| {
        let mut fields = line.trim().split(':');
        let (owner, first, count) = (fields.next()?, fields.next()?, fields.next()?);
        if owner != user && owner != uid.to_string() {
            return None;
        }
        let first: u32 = first.parse().ok()?;
        let count: u32 = count.parse().ok()?;
        let usable = first > 0 && count > 0 && first.checked_add(count).is_some();
        usable.then_some((first, count.min(MAX_UIDS)))
    })
}

/// A range of uids and which of them a QEMU holds.
struct Pool {
    first: u32,
    in_use: Vec<bool>,
}

impl Pool {
    fn take(&mut self) -> Option<(usize, u32)> {
        let index = self.in_use.iter().position(|used| !used)?;
        self.in_use[index] = true;
        Some((index, self.first + index as u32))
    }
}

/// `None` until the first lease reads the range.
static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// A uid of its own for one QEMU process; given back on drop, which must come after the
/// process was reaped (a [`super::Vm`] drops it last).
#[derive(Debug)]
pub(crate) struct UidLease {
    index: usize,
    pub uid: u32,
}

impl Drop for UidLease {
    fn drop(&mut self) {
        if let Some(pool) = POOL.lock().as_mut() {
            pool.in_use[self.index] = false;
        }
    }
}

/// A free uid of `user`'s subordinate range (`uid` is the account's own, which may name
/// the range too). `None` when the account has no range, or every uid of it is in use:
/// the QEMU then runs as the account.
pub(crate) fn lease(user: &str, uid: u32) -> Option<UidLease> {
    let mut pool = POOL.lock();
    let pool = pool.get_or_insert_with(|| {
        let text = std::fs::read_to_string(SUBUID_FILE).unwrap_or_default();
        match range_of(&text, user, uid) {
            Some((first, count)) => {
                log::info!(
                    "vm op=uids first={first} count={count} \
                     detail=\"each QEMU runs as a uid of its own\""
                );
                Pool {
                    first,
                    in_use: vec![false; count as usize],
                }
            }
            None => {
                log::warn!(
                    "vm op=uids result=shared detail=\"{user} has no subordinate uid range in \
                     {SUBUID_FILE}: every QEMU runs as {user}, so one QEMU taken over by its \
                     guest can signal or ptrace another; run scripts/setup.sh (usermod \
                     --add-subuids) to give each QEMU a uid of its own\""
                );
                Pool {
                    first: 0,
                    in_use: Vec::new(),
                }
            }
        }
    });
    let (index, uid) = pool.take()?;
    Some(UidLease { index, uid })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_accounts_range() {
        let text = "alice:100000:65536\nagentenv-vm:165536:65536\n";
        assert_eq!(range_of(text, "agentenv-vm", 999), Some((165536, 65536)));
        assert_eq!(
            range_of("999:300000:10\n", "agentenv-vm", 999),
            Some((300000, 10))
        );
        assert_eq!(range_of(text, "bob", 1000), None);
        assert_eq!(range_of("agentenv-vm:0:10\n", "agentenv-vm", 999), None);
        assert_eq!(range_of("agentenv-vm:x:10\n", "agentenv-vm", 999), None);
        assert_eq!(
            range_of("agentenv-vm:4294967290:100\n", "agentenv-vm", 999),
            None
        );
        assert_eq!(
            range_of("agentenv-vm:200000:1000000\n", "agentenv-vm", 999),
            Some((200000, MAX_UIDS))
        );
    }

    #[test]
    fn hands_out_each_uid_once() {
        let mut pool = Pool {
            first: 500,
            in_use: vec![false; 2],
        };
        assert_eq!(pool.take(), Some((0, 500)));
        assert_eq!(pool.take(), Some((1, 501)));
        assert_eq!(pool.take(), None);
        pool.in_use[0] = false;
        assert_eq!(pool.take(), Some((0, 500)));
    }
}
