//! A table of the sweep file whose keys belong to several groups of settings (each group declared
//! once, for its flags and its keys), read key by key so that an error keeps its key's line as
//! serde's own errors do: a key no group takes is refused with the keys there are, and a value its
//! group refuses is named by its key at its line.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Error, MapAccess, Visitor};
use serde::Deserialize;

/// A group's keys and how one of its values is read: its group's type made of that key alone (and
/// checked), an error saying what is wrong.
pub struct Group<'a> {
    pub keys: Vec<String>,
    pub read: &'a dyn Fn(toml::Table) -> Result<(), String>,
}

impl<'a> Group<'a> {
    pub fn new(keys: Vec<String>, read: &'a dyn Fn(toml::Table) -> Result<(), String>) -> Group<'a> {
        Group { keys, read }
    }
}

/// A group's type made of `table` (some of its keys), an error as its message.
pub fn typed<T: serde::de::DeserializeOwned>(table: toml::Table) -> Result<T, String> {
    toml::Value::Table(table)
        .try_into()
        .map_err(|e: toml::de::Error| e.message().to_string())
}

/// The keys of a struct that derives `Deserialize`, as serde asks for them: the field names its
/// derived code hands a deserializer (which answers nothing).
pub fn keys_of<'de, T: Deserialize<'de>>() -> Vec<String> {
    struct Asked(Vec<&'static str>);

    impl<'de> Deserializer<'de> for &mut Asked {
        type Error = serde::de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(Error::custom("not a struct"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = fields.to_vec();
            Err(Error::custom("asked"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option
            unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }

    let mut asked = Asked(Vec::new());
    let _ = T::deserialize(&mut asked);
    asked.0.into_iter().map(String::from).collect()
}

/// The table, each value read by its group.
pub fn read<'de, D: Deserializer<'de>>(d: D, groups: &[Group]) -> Result<toml::Table, D::Error> {
    d.deserialize_map(Table { groups })
}

/// A group's type made of the values of its `keys` in `table`.
pub fn take<T: serde::de::DeserializeOwned>(table: &toml::Table, keys: &[String]) -> Result<T, String> {
    typed(
        table
            .iter()
            .filter(|(k, _)| keys.contains(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    )
}

struct Table<'g, 'a> {
    groups: &'g [Group<'a>],
}

impl<'de> Visitor<'de> for Table<'_, '_> {
    type Value = toml::Table;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a table of settings")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<toml::Table, A::Error> {
        let mut table = toml::Table::new();
        while let Some(group) = map.next_key_seed(Key { groups: self.groups })? {
            let (key, group) = group;
            let value = map.next_value_seed(Value { key: &key, group })?;
            table.insert(key, value);
        }
        Ok(table)
    }
}

/// A key, refused where no group takes it (the error raised while reading the key carries its line).
struct Key<'g, 'a> {
    groups: &'g [Group<'a>],
}

impl<'de, 'g, 'a> DeserializeSeed<'de> for Key<'g, 'a> {
    type Value = (String, &'g Group<'a>);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let key = String::deserialize(d)?;
        match self.groups.iter().find(|g| g.keys.contains(&key)) {
            Some(group) => Ok((key, group)),
            None => {
                // Worded as serde words the file's other tables' unknown keys.
                let every: Vec<String> = self
                    .groups
                    .iter()
                    .flat_map(|g| &g.keys)
                    .map(|k| format!("`{k}`"))
                    .collect();
                Err(D::Error::custom(format!(
                    "unknown field `{key}`, expected one of {}",
                    every.join(", ")
                )))
            }
        }
    }
}

/// A value, read by its key's group (the error raised while reading the value carries its line).
struct Value<'k, 'g, 'a> {
    key: &'k str,
    group: &'g Group<'a>,
}

impl<'de> DeserializeSeed<'de> for Value<'_, '_, '_> {
    type Value = toml::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<toml::Value, D::Error> {
        let value = toml::Value::deserialize(d)?;
        (self.group.read)(toml::Table::from_iter([(self.key.to_string(), value.clone())]))
            .map_err(|e| D::Error::custom(format!("{}: {e}", self.key)))?;
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Small {
        #[serde(default)]
        n: Option<u8>,
    }

    struct Holder(toml::Table);

    impl<'de> Deserialize<'de> for Holder {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let small = |t: toml::Table| typed::<Small>(t).map(|_| ());
            let flag = |t: toml::Table| match t.get("on") {
                Some(toml::Value::Boolean(_)) => Ok(()),
                _ => Err("expected true or false".to_string()),
            };
            let groups = [
                Group::new(vec!["n".into()], &small),
                Group::new(vec!["on".into()], &flag),
            ];
            read(d, &groups).map(Holder)
        }
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct File {
        name: String,
        settings: Holder,
    }

    fn err(text: &str) -> String {
        toml::from_str::<File>(text).err().unwrap().to_string()
    }

    #[test]
    fn a_struct_s_keys_are_the_ones_serde_reads() {
        assert_eq!(keys_of::<Small>(), ["n"]);
        assert_eq!(keys_of::<File>(), ["name", "settings"]);
        assert!(keys_of::<String>().is_empty());
    }

    #[test]
    fn a_key_and_a_value_are_refused_at_their_line() {
        let ok: File = toml::from_str("name = \"x\"\n[settings]\nn = 3\non = true\n").unwrap();
        assert_eq!(ok.settings.0.len(), 2);
        let e = err("name = \"x\"\n[settings]\nn = 3\nof = true\n");
        assert!(
            e.contains("line 4") && e.contains("`of`") && e.contains("`n`, `on`"),
            "{e}"
        );
        let e = err("name = \"x\"\n[settings]\non = true\nn = 300\n");
        assert!(e.contains("line 4") && e.contains("n: "), "{e}");
        let e = err("name = \"x\"\n[settings]\non = 1\n");
        assert!(e.contains("line 3") && e.contains("on: expected true or false"), "{e}");
    }
}
