//! `extraBootArgs` from a start-fresh response (custom-extension.md §11.2).

/// The x86-64 kernel's `COMMAND_LINE_SIZE` (2048) minus its terminating NUL.
pub const CMDLINE_LIMIT: usize = 2047;

/// Checks `raw` for appending to a kernel command line of `base_cmdline_len` bytes, as one
/// space followed by the trimmed arguments (custom-extension.md §11.3).
///
/// Returns `Ok(None)` when nothing is left after trimming, `Ok(Some(args))` with the
/// trimmed arguments, or `Err(why)` with the text that follows `extraBootArgs rejected: `.
/// The byte index in `invalid character at byte <i>` counts from 0 in the *trimmed*
/// string, the one that would be appended.
pub fn process(raw: &str, base_cmdline_len: usize) -> Result<Option<String>, String> {
    let args = raw.trim_matches(|c| matches!(c, ' ' | '\t' | '\r' | '\n'));
    if args.is_empty() {
        return Ok(None);
    }
    if let Some(i) = args.bytes().position(|b| !(0x20..=0x7e).contains(&b)) {
        return Err(format!("invalid character at byte {i}"));
    }
    let total = base_cmdline_len + 1 + args.len();
    if total > CMDLINE_LIMIT {
        return Err(format!(
            "command line would be {total} bytes, limit {CMDLINE_LIMIT}"
        ));
    }
    Ok(Some(args.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_spaces_tabs_cr_lf_only() {
        assert_eq!(process(" \t\r\n", 10), Ok(None));
        assert_eq!(process("", 10), Ok(None));
        assert_eq!(
            process("\n\t quiet foo=\"a b\" -- x \r\n", 10),
            Ok(Some("quiet foo=\"a b\" -- x".into()))
        );
        // A vertical tab is not trimmed, so it is rejected where it stands.
        assert_eq!(
            process("\x0bquiet", 10),
            Err("invalid character at byte 0".into())
        );
    }

    #[test]
    fn rejects_non_printable_with_index_in_trimmed_args() {
        assert_eq!(
            process("  ab\tc", 10),
            Err("invalid character at byte 2".into())
        );
        assert_eq!(
            process("a\nb", 10),
            Err("invalid character at byte 1".into())
        );
        assert_eq!(
            process("ab\x7f", 10),
            Err("invalid character at byte 2".into())
        );
        assert_eq!(
            process("x\0", 10),
            Err("invalid character at byte 1".into())
        );
        // Non-ASCII: the index is that of the first byte of the UTF-8 sequence.
        assert_eq!(
            process(" café", 10),
            Err("invalid character at byte 3".into())
        );
        assert_eq!(process("~ !", 10), Ok(Some("~ !".into())));
    }

    #[test]
    fn enforces_the_2047_byte_limit_including_the_space() {
        let base = 2000;
        let fits = "a".repeat(CMDLINE_LIMIT - base - 1);
        assert_eq!(process(&fits, base), Ok(Some(fits.clone())));
        let over = format!("{fits}b");
        assert_eq!(
            process(&over, base),
            Err("command line would be 2048 bytes, limit 2047".into())
        );
        // Trimmed bytes do not count.
        assert_eq!(
            process(&format!("  {fits}\n"), base),
            Ok(Some(fits.clone()))
        );
    }
}
