//! The module's one error type and the causes of custom-extension.md §7.5.

use super::Hook;
use std::fmt;

/// Why one hook attempt failed. `Display` is the `<cause>` of custom-extension.md §7.5.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// Connect, DNS, TLS or I/O error (never contains the token or the request body).
    Connection(String),
    /// The attempt ran past `timeout_ms`.
    TimedOut { ms: u64 },
    /// A final non-2xx, non-3xx status.
    Status(u16),
    /// A 3xx status; redirects are never followed (custom-extension.md §2.4).
    Redirect(u16),
    /// More than 1 MiB of response body, announced or found while reading (custom-extension.md §2.5).
    BodyTooLarge,
    /// A body that the hook requires to be a JSON object is not one.
    NotJsonObject,
    /// start-fresh: `extraBootArgs` is neither a string nor null.
    ExtraBootArgsType,
    /// start-fresh: `extraBootArgs` failed custom-extension.md §11.2; the text after `rejected: `.
    ExtraBootArgsRejected(String),
    /// patch-params: `customExtensionParams` is neither an object nor null.
    ParamsType,
}

impl Cause {
    /// Whether a failed stop attempt with this cause is retried (custom-extension.md §8.3): connection
    /// errors, timeouts, 408, 429, 5xx and oversized bodies. Any 3xx and other 4xx are a
    /// definite answer or a misconfiguration and are not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Cause::Connection(_) | Cause::TimedOut { .. } | Cause::BodyTooLarge => true,
            Cause::Status(s) => !(400..500).contains(s) || *s == 408 || *s == 429,
            Cause::Redirect(_) => false,
            // Body rules do not apply to stop; never reached for it.
            Cause::NotJsonObject
            | Cause::ExtraBootArgsType
            | Cause::ExtraBootArgsRejected(_)
            | Cause::ParamsType => false,
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::Connection(d) => write!(f, "connection failed: {d}"),
            Cause::TimedOut { ms } => write!(f, "timed out after {ms} ms"),
            Cause::Status(s) => write!(f, "HTTP {s}"),
            Cause::Redirect(s) => write!(f, "redirect (HTTP {s}) not followed"),
            Cause::BodyTooLarge => f.write_str("response body exceeds 1 MiB"),
            Cause::NotJsonObject => f.write_str("response is not a JSON object"),
            Cause::ExtraBootArgsType => f.write_str("extraBootArgs must be a string or null"),
            Cause::ExtraBootArgsRejected(why) => write!(f, "extraBootArgs rejected: {why}"),
            Cause::ParamsType => f.write_str("customExtensionParams must be an object or null"),
        }
    }
}

/// Errors of the hook client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookError {
    /// The extension is disabled; the API maps this to 400 (custom-extension.md §1.7, §10.11).
    Disabled,
    /// A hook failed (custom-extension.md §7): the API maps this to 502.
    Failed { hook: Hook, cause: Cause },
    /// The open-instance journal could not be read or written. For a start, the hook was
    /// not sent (custom-extension.md §4.3), so no stop is owed either.
    Journal(String),
}

impl HookError {
    /// The cause, when this is a hook failure.
    pub fn cause(&self) -> Option<&Cause> {
        match self {
            HookError::Failed { cause, .. } => Some(cause),
            _ => None,
        }
    }
}

impl fmt::Display for HookError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HookError::Disabled => f.write_str(
                "the custom extension is disabled; set [custom_extension].url to use customExtensionParams",
            ),
            HookError::Failed { hook, cause } => {
                write!(f, "custom extension hook {hook} failed: {cause}")
            }
            HookError::Journal(detail) => write!(f, "hook journal: {detail}"),
        }
    }
}

impl std::error::Error for HookError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_classification_follows_ce_8_3() {
        for s in [408, 429, 500, 502, 503, 504, 599] {
            assert!(Cause::Status(s).is_retryable(), "{s}");
        }
        for s in [400, 401, 403, 404, 409, 410, 422, 499] {
            assert!(!Cause::Status(s).is_retryable(), "{s}");
        }
        assert!(!Cause::Redirect(302).is_retryable());
        assert!(!Cause::Redirect(301).is_retryable());
        assert!(Cause::Connection("refused".into()).is_retryable());
        assert!(Cause::TimedOut { ms: 5 }.is_retryable());
        assert!(Cause::BodyTooLarge.is_retryable());
    }

    #[test]
    fn messages_are_those_of_ce_7_5() {
        let m = |hook, cause| HookError::Failed { hook, cause }.to_string();
        assert_eq!(
            m(Hook::StartFresh, Cause::TimedOut { ms: 250 }),
            "custom extension hook start-fresh failed: timed out after 250 ms"
        );
        assert_eq!(
            m(Hook::PatchParams, Cause::Redirect(302)),
            "custom extension hook patch-params failed: redirect (HTTP 302) not followed"
        );
        assert_eq!(
            m(Hook::Stop, Cause::Status(503)),
            "custom extension hook stop failed: HTTP 503"
        );
        assert_eq!(
            m(Hook::StartResume, Cause::BodyTooLarge),
            "custom extension hook start-resume failed: response body exceeds 1 MiB"
        );
        assert_eq!(
            m(
                Hook::StartFresh,
                Cause::ExtraBootArgsRejected("invalid character at byte 3".into())
            ),
            "custom extension hook start-fresh failed: extraBootArgs rejected: invalid character at byte 3"
        );
    }
}
