//! E2B's template catalog (`/v3/templates`, tags, aliases): a template is an id with a
//! name (its alias) and builds; its tags point at builds, `default` at the latest ready
//! one. Each ready build is a snapshot (`snapshots/<buildID>/`) that `POST /sandboxes`
//! starts from; a build no tag points at any more is garbage-collected with its snapshot.
//! One record per template in `<state_dir>/catalog/<templateID>.json`, written atomically
//! before a change is visible.

use super::OrchError;
use crate::util::is_uuid;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::SystemTime;

/// The tag every ready build gets, and the one a bare name means.
pub const DEFAULT_TAG: &str = "default";

/// One template of the catalog.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CatalogTemplate {
    pub id: String,
    pub name: String,
    /// tag → the ready build it points at, and when it was set.
    pub tags: BTreeMap<String, TagTarget>,
    /// Every build asked for (ready, failed or running), oldest first.
    pub builds: Vec<String>,
    pub build_count: u64,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TagTarget {
    pub build_id: String,
    pub created_at: SystemTime,
}

impl CatalogTemplate {
    /// The latest ready build (`default`).
    pub fn current(&self) -> Option<&str> {
        self.tags.get(DEFAULT_TAG).map(|t| t.build_id.as_str())
    }
}

/// The ids a build is made with when another node chose them (a cluster's build runs on
/// every node under the same ids, docs/cluster.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildIds {
    pub template_id: String,
    pub build_id: String,
}

/// Splits `name[:tag]`.
pub fn split_tag(name: &str) -> (&str, Option<&str>) {
    match name.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (name, None),
    }
}

/// A tag: `[A-Za-z0-9_.-]{1,128}`.
pub fn valid_tag(t: &str) -> bool {
    (1..=128).contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

pub(crate) struct Catalog {
    dir: PathBuf,
    templates: Mutex<BTreeMap<String, CatalogTemplate>>,
}

impl Catalog {
    /// Loads the records; unreadable ones are quarantined, never removed.
    pub fn load(dir: PathBuf) -> Catalog {
        let mut templates = BTreeMap::new();
        let state_dir = dir.parent().map(PathBuf::from).unwrap_or_default();
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                match std::fs::read(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|b| {
                        serde_json::from_slice::<CatalogTemplate>(&b).map_err(|e| e.to_string())
                    }) {
                    Ok(t) => {
                        templates.insert(t.id.clone(), t);
                    }
                    Err(why) => {
                        crate::store::quarantine(&state_dir, &path, &why);
                    }
                }
            }
        }
        Catalog {
            dir,
            templates: Mutex::new(templates),
        }
    }

    fn save(&self, t: &CatalogTemplate) -> Result<(), OrchError> {
        crate::store::ensure_private_dir(&self.dir)?;
        Ok(crate::store::write_json(
            &self.dir.join(format!("{}.json", t.id)),
            t,
        )?)
    }

    pub fn list(&self) -> Vec<CatalogTemplate> {
        self.templates.lock().values().cloned().collect()
    }

    /// By id, or by name (`name:tag` names the same template).
    pub fn find(&self, id_or_name: &str) -> Option<CatalogTemplate> {
        let (name, _) = split_tag(id_or_name);
        let map = self.templates.lock();
        if is_uuid(name) {
            return map.get(name).cloned();
        }
        map.values().find(|t| t.name == name).cloned()
    }

    /// The ready build `id_or_name[:tag]` means, when it is a catalog template.
    pub fn resolve(&self, id_or_name: &str) -> Option<Result<String, OrchError>> {
        let t = self.find(id_or_name)?;
        let tag = split_tag(id_or_name).1.unwrap_or(DEFAULT_TAG);
        Some(t.tags.get(tag).map(|t| t.build_id.clone()).ok_or_else(|| {
            OrchError::BadRequest(format!(
                "template {} has no ready build{}",
                t.name,
                if tag == DEFAULT_TAG {
                    String::new()
                } else {
                    format!(" tagged {tag}")
                }
            ))
        }))
    }

    /// The template named `name`, made when new (with the id `template_id` when
    /// given); the build is added to it. 409 when `template_id` names another template.
    pub fn add_build(
        &self,
        name: &str,
        build_id: &str,
        template_id: Option<&str>,
    ) -> Result<CatalogTemplate, OrchError> {
        let mut map = self.templates.lock();
        let now = SystemTime::now();
        let existing = map.values().find(|t| t.name == name).cloned();
        if let Some(want) = template_id {
            let clash = match &existing {
                Some(t) if t.id != want => Some(format!("this node has it as {}", t.id)),
                None => map
                    .get(want)
                    .map(|t| format!("this node has {want} as {}", t.name)),
                _ => None,
            };
            if let Some(clash) = clash {
                return Err(OrchError::Conflict(format!(
                    "template {name} cannot get the id {want}: {clash} (the nodes' catalogs differ: delete the template through any node and build it again)"
                )));
            }
        }
        let mut t = existing.unwrap_or_else(|| CatalogTemplate {
            id: template_id.map_or_else(crate::util::new_id, str::to_string),
            name: name.to_string(),
            tags: BTreeMap::new(),
            builds: Vec::new(),
            build_count: 0,
            created_at: now,
            updated_at: now,
        });
        t.builds.push(build_id.to_string());
        t.build_count += 1;
        t.updated_at = now;
        self.save(&t)?;
        map.insert(t.id.clone(), t.clone());
        Ok(t)
    }

    /// Points `tags` (and `default`) at the build that became ready; returns the builds no
    /// tag points at any more, which the caller deletes.
    pub fn set_ready(
        &self,
        template_id: &str,
        build_id: &str,
        tags: &[String],
        finished: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<String>, OrchError> {
        let mut map = self.templates.lock();
        let Some(mut t) = map.get(template_id).cloned() else {
            return Err(OrchError::NotFound(format!(
                "template {template_id} was deleted during its build"
            )));
        };
        let now = SystemTime::now();
        for tag in tags.iter().map(String::as_str).chain([DEFAULT_TAG]) {
            t.tags.insert(
                tag.to_string(),
                TagTarget {
                    build_id: build_id.to_string(),
                    created_at: now,
                },
            );
        }
        t.updated_at = now;
        let orphans = unreferenced(&mut t, build_id, finished);
        self.save(&t)?;
        map.insert(t.id.clone(), t);
        Ok(orphans)
    }

    /// Drops a failed build from its template; a template left without any build goes.
    pub fn drop_build(&self, template_id: &str, build_id: &str) {
        let mut map = self.templates.lock();
        let Some(mut t) = map.get(template_id).cloned() else {
            return;
        };
        t.builds.retain(|b| b != build_id);
        if t.builds.is_empty() && t.tags.is_empty() {
            map.remove(template_id);
            let _ = std::fs::remove_file(self.dir.join(format!("{template_id}.json")));
            return;
        }
        if self.save(&t).is_ok() {
            map.insert(t.id.clone(), t);
        }
    }

    /// Assigns `tags` to the build `target` (`name:tag`) points at.
    pub fn assign_tags(&self, target: &str, tags: &[String]) -> Result<String, OrchError> {
        let build = self
            .resolve(target)
            .ok_or_else(|| OrchError::NotFound(format!("template {target} not found")))??;
        let t = self.find(target).expect("resolved");
        let mut map = self.templates.lock();
        let mut t = map.get(&t.id).cloned().unwrap_or(t);
        let now = SystemTime::now();
        for tag in tags {
            t.tags.insert(
                tag.clone(),
                TagTarget {
                    build_id: build.clone(),
                    created_at: now,
                },
            );
        }
        self.save(&t)?;
        map.insert(t.id.clone(), t);
        Ok(build)
    }

    /// Removes `tags` from template `name`; returns the builds left unreferenced.
    pub fn remove_tags(
        &self,
        name: &str,
        tags: &[String],
        finished: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<String>, OrchError> {
        let t = self
            .find(name)
            .ok_or_else(|| OrchError::NotFound(format!("template {name} not found")))?;
        let mut map = self.templates.lock();
        let mut t = map.get(&t.id).cloned().unwrap_or(t);
        for tag in tags {
            if t.tags.remove(tag).is_none() {
                return Err(OrchError::NotFound(format!(
                    "template {} has no tag {tag}",
                    t.name
                )));
            }
        }
        let orphans = unreferenced(&mut t, "", finished);
        self.save(&t)?;
        map.insert(t.id.clone(), t);
        Ok(orphans)
    }

    /// Removes the template's record; returns it (its builds are the caller's to delete).
    pub fn remove(&self, id_or_name: &str) -> Option<CatalogTemplate> {
        let t = self.find(id_or_name)?;
        self.templates.lock().remove(&t.id);
        let _ = std::fs::remove_file(self.dir.join(format!("{}.json", t.id)));
        Some(t)
    }
}

/// Finished builds of `t` that no tag points at, except `keep`, taken out of `t.builds`
/// (builds still waiting or running stay).
fn unreferenced(
    t: &mut CatalogTemplate,
    keep: &str,
    finished: &dyn Fn(&str) -> bool,
) -> Vec<String> {
    let referenced: Vec<&str> = t.tags.values().map(|x| x.build_id.as_str()).collect();
    let (kept, orphans): (Vec<String>, Vec<String>) = t
        .builds
        .iter()
        .cloned()
        .partition(|b| b == keep || referenced.contains(&b.as_str()) || !finished(b));
    t.builds = kept;
    orphans
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog() -> Catalog {
        let dir = std::env::temp_dir().join(format!("aenv-catalog-{}", crate::util::new_id()));
        Catalog::load(dir)
    }

    #[test]
    fn a_build_may_take_the_ids_another_node_chose() {
        let c = catalog();
        let id = "01900000-0000-7000-8000-00000000000a";
        let t = c.add_build("app", "b1", Some(id)).unwrap();
        assert_eq!(t.id, id);
        assert_eq!(c.add_build("app", "b2", Some(id)).unwrap().id, id);
        // The nodes' catalogs differ: refused, naming the ids.
        let other = "01900000-0000-7000-8000-00000000000b";
        let e = c.add_build("app", "b3", Some(other)).unwrap_err();
        assert!(
            matches!(&e, OrchError::Conflict(m) if m.contains(id)),
            "{e:?}"
        );
        let e = c.add_build("web", "b4", Some(id)).unwrap_err();
        assert!(
            matches!(&e, OrchError::Conflict(m) if m.contains("as app")),
            "{e:?}"
        );
        let _ = std::fs::remove_dir_all(&c.dir);
    }

    #[test]
    fn builds_tags_and_collection() {
        let c = catalog();
        let t = c.add_build("app", "b1", None).unwrap();
        assert!(c.resolve("app").unwrap().is_err(), "nothing ready yet");
        assert!(c
            .set_ready(&t.id, "b1", &["v1".into()], &|_| true)
            .unwrap()
            .is_empty());
        assert_eq!(c.resolve("app").unwrap().unwrap(), "b1");
        assert_eq!(c.resolve("app:v1").unwrap().unwrap(), "b1");
        assert_eq!(c.resolve(&t.id).unwrap().unwrap(), "b1");
        let t2 = c.add_build("app", "b2", None).unwrap();
        assert_eq!(t2.id, t.id, "one template per name");
        // b1 keeps its v1 tag, so it is not collected; a third build frees it.
        assert!(c.set_ready(&t.id, "b2", &[], &|_| true).unwrap().is_empty());
        assert_eq!(c.resolve("app").unwrap().unwrap(), "b2");
        assert_eq!(
            c.remove_tags("app", &["v1".into()], &|_| true).unwrap(),
            vec!["b1"]
        );
        c.add_build("app", "b3", None).unwrap();
        assert_eq!(
            c.set_ready(&t.id, "b3", &[], &|_| true).unwrap(),
            vec!["b2"]
        );
        // Reloaded from disk, the same.
        let again = Catalog::load(c.dir.clone());
        assert_eq!(again.resolve("app").unwrap().unwrap(), "b3");
        assert!(c.resolve("other").is_none());
        let _ = std::fs::remove_dir_all(&c.dir);
    }

    #[test]
    fn a_failed_first_build_leaves_no_template() {
        let c = catalog();
        let t = c.add_build("x", "b1", None).unwrap();
        c.drop_build(&t.id, "b1");
        assert!(c.find("x").is_none());
        let _ = std::fs::remove_dir_all(&c.dir);
    }
}
