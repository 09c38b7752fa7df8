//! User metadata on files (envd 0.6.2): an upload's `X-Metadata-<key>: <value>` headers
//! are kept as the written file's extended attributes `user.e2b.<key>` (keys lowercased),
//! and `EntryInfo` (Stat, ListDir, Move, watch events) and the upload's answer carry every
//! `user.e2b.*` attribute of a file back as `metadata`, also ones set inside the guest.
//!
//! Keys and values follow the SDKs' rules (keys: HTTP token characters; values:
//! printable US-ASCII) and are bounded so that one file's set fits the extended attribute
//! space ext4 gives an inode (one 4 KiB block): at most [`MAX_ENTRIES`] keys of
//! [`MAX_KEY_BYTES`], values of [`MAX_VALUE_BYTES`], [`MAX_TOTAL_BYTES`] in all.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use tiny_http::Request;

/// The attribute namespace of user metadata.
pub const XATTR_PREFIX: &str = "user.e2b.";
/// The upload header prefix (case-insensitive).
const HEADER_PREFIX: &str = "x-metadata-";
pub const MAX_ENTRIES: usize = 32;
pub const MAX_KEY_BYTES: usize = 128;
pub const MAX_VALUE_BYTES: usize = 1024;
pub const MAX_TOTAL_BYTES: usize = 3072;

/// Metadata as given on an upload: lowercased key → value, checked.
pub type Metadata = BTreeMap<String, String>;

fn token_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c)
}

/// The metadata of an upload's `X-Metadata-*` headers, or why it is refused (a 400).
pub fn from_request(req: &Request) -> Result<Metadata, String> {
    let mut metadata = Metadata::new();
    let mut total = 0;
    for h in req.headers() {
        let field = h.field.as_str().as_str();
        if field.len() < HEADER_PREFIX.len()
            || !field[..HEADER_PREFIX.len()].eq_ignore_ascii_case(HEADER_PREFIX)
        {
            continue;
        }
        let key = field[HEADER_PREFIX.len()..].to_ascii_lowercase();
        let value = h.value.as_str();
        check_entry(&key, value)?;
        total += key.len() + value.len();
        if metadata.insert(key.clone(), value.to_string()).is_some() {
            return Err(format!("metadata key {key:?} is given twice"));
        }
    }
    if metadata.len() > MAX_ENTRIES {
        return Err(format!(
            "{} metadata keys given; at most {MAX_ENTRIES} are kept per file",
            metadata.len()
        ));
    }
    if total > MAX_TOTAL_BYTES {
        return Err(format!(
            "metadata of {total} bytes given; at most {MAX_TOTAL_BYTES} bytes (keys and \
             values) are kept per file"
        ));
    }
    Ok(metadata)
}

fn check_entry(key: &str, value: &str) -> Result<(), String> {
    if key.is_empty() || !key.chars().all(token_char) {
        return Err(format!(
            "invalid metadata key {key:?}: keys must be non-empty and use only HTTP token \
             characters (letters, digits and !#$%&'*+-.^_`|~)"
        ));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(format!(
            "metadata key {key:?} is {} bytes; at most {MAX_KEY_BYTES}",
            key.len()
        ));
    }
    if !value.chars().all(|c| (' '..='~').contains(&c)) {
        return Err(format!(
            "invalid metadata value for key {key:?}: values must be printable US-ASCII"
        ));
    }
    if value.len() > MAX_VALUE_BYTES {
        return Err(format!(
            "metadata value for key {key:?} is {} bytes; at most {MAX_VALUE_BYTES}",
            value.len()
        ));
    }
    Ok(())
}

/// Sets `metadata` on the open `file` as `user.e2b.<key>` attributes.
pub fn apply(file: &File, metadata: &Metadata) -> Result<(), crate::sys::SysError> {
    for (key, value) in metadata {
        crate::sys::guest::set_xattr(file, &format!("{XATTR_PREFIX}{key}"), value.as_bytes())?;
    }
    Ok(())
}

/// Every `user.e2b.*` attribute of `path` itself, as metadata; `None` when it has none
/// (or they cannot be read).
pub fn read(path: &Path) -> Option<Metadata> {
    let attrs = crate::sys::guest::xattrs_with_prefix(path, XATTR_PREFIX).ok()?;
    let metadata: Metadata = attrs
        .into_iter()
        .map(|(name, value)| {
            (
                name[XATTR_PREFIX.len()..].to_string(),
                String::from_utf8_lossy(&value).into_owned(),
            )
        })
        .collect();
    (!metadata.is_empty()).then_some(metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_values_follow_the_sdks_rules() {
        assert!(check_entry("owner", "team a").is_ok());
        assert!(check_entry("a.b-c_d~", "").is_ok());
        assert!(check_entry("", "x").is_err());
        assert!(check_entry("a b", "x").is_err());
        assert!(check_entry("a/b", "x").is_err());
        assert!(check_entry("k", "tab\there").is_err());
        assert!(check_entry("k", "é").is_err());
        assert!(check_entry(&"k".repeat(MAX_KEY_BYTES + 1), "x").is_err());
        assert!(check_entry("k", &"v".repeat(MAX_VALUE_BYTES + 1)).is_err());
    }
}
