//! Command-line words: options (`--name VALUE`, `--name=VALUE`, or a bare switch) anywhere
//! before `--`, everything else positional. Commands take their options by name; whatever
//! is left is an error.

use super::CliError;

/// Options that take no value.
const SWITCHES: &[&str] = &[
    "--json",
    "--help",
    "-h",
    "--no-auto-pause",
    "--no-wait",
    "--stdin",
    "-i",
];

pub struct Args {
    options: Vec<(String, Option<String>)>,
    pub positional: Vec<String>,
}

impl Args {
    pub fn new(words: Vec<String>) -> Result<Args, CliError> {
        let mut options = Vec::new();
        let mut positional = Vec::new();
        let mut words = words.into_iter();
        while let Some(w) = words.next() {
            if w == "--" {
                positional.extend(words.by_ref());
            } else if let Some((name, value)) = w.split_once('=').filter(|_| w.starts_with("--")) {
                options.push((name.to_string(), Some(value.to_string())));
            } else if SWITCHES.contains(&w.as_str()) {
                options.push((w, None));
            } else if w.starts_with('-') && w != "-" {
                let value = words
                    .next()
                    .ok_or_else(|| CliError::Usage(format!("{w} needs a value")))?;
                options.push((w, Some(value)));
            } else {
                positional.push(w);
            }
        }
        Ok(Args {
            options,
            positional,
        })
    }

    /// Takes the first `name VALUE`.
    pub fn value(&mut self, name: &str) -> Result<Option<String>, CliError> {
        match self.options.iter().position(|(n, _)| n == name) {
            None => Ok(None),
            Some(i) => match self.options.remove(i).1 {
                Some(v) => Ok(Some(v)),
                None => Err(CliError::Usage(format!("{name} needs a value"))),
            },
        }
    }

    /// Takes every `name VALUE`, in order.
    pub fn values(&mut self, name: &str) -> Result<Vec<String>, CliError> {
        let mut all = Vec::new();
        while let Some(v) = self.value(name)? {
            all.push(v);
        }
        Ok(all)
    }

    /// Takes a switch.
    pub fn flag(&mut self, name: &str) -> bool {
        let before = self.options.len();
        self.options.retain(|(n, _)| n != name);
        self.options.len() != before
    }

    /// Fails on options no one took.
    pub fn finish(&self) -> Result<(), CliError> {
        match self.options.first() {
            None => Ok(()),
            Some((name, _)) => Err(CliError::Usage(format!(
                "unknown option {name} (options after -- are the command's)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Args {
        Args::new(words.iter().map(|w| w.to_string()).collect()).unwrap()
    }

    #[test]
    fn options_values_switches_and_the_rest() {
        let mut a = args(&[
            "sandbox",
            "exec",
            "--env",
            "A=1",
            "id1",
            "--env=B=2",
            "--json",
            "--",
            "ls",
            "-la",
        ]);
        assert!(a.flag("--json"));
        assert_eq!(a.values("--env").unwrap(), ["A=1", "B=2"]);
        a.finish().unwrap();
        assert_eq!(a.positional, ["sandbox", "exec", "id1", "ls", "-la"]);
    }

    #[test]
    fn unknown_and_incomplete_options_are_usage_errors() {
        let a = args(&["sandbox", "ls", "--bogus", "x"]);
        assert!(matches!(a.finish(), Err(CliError::Usage(_))));
        assert!(Args::new(vec!["--image".into()]).is_err());
    }
}
