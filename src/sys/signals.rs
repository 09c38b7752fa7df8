//! Termination signals, handled synchronously: SIGTERM and SIGINT are blocked in every
//! thread (threads inherit the mask) and one thread waits for them with `sigwait`.

use super::{SysError, SysResult};

fn termination_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before use, and the
    // signal numbers are valid.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        set
    }
}

/// Blocks SIGTERM and SIGINT in the calling thread. Call before spawning any thread.
pub fn block_termination_signals() -> SysResult<()> {
    let set = termination_set();
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if ret != 0 {
        return Err(SysError::from_errno("pthread_sigmask", ret));
    }
    Ok(())
}

/// Waits until SIGTERM or SIGINT arrives; returns the signal number.
pub fn wait_for_termination() -> SysResult<i32> {
    let set = termination_set();
    let mut sig: libc::c_int = 0;
    // SAFETY: `set` is initialised and `sig` is a valid out-pointer.
    let ret = unsafe { libc::sigwait(&set, &mut sig) };
    if ret != 0 {
        return Err(SysError::from_errno("sigwait", ret));
    }
    Ok(sig)
}
