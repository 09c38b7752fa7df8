//! API errors: a status and a message, rendered as `{"code": N, "message": "..."}`.

use crate::orchestrator::OrchError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// Methods for the `Allow` header of a 405.
    pub allow: Option<String>,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            allow: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, message)
    }

    pub fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError::new(422, message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(401, "missing or invalid X-API-Key header")
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(404, message)
    }

    pub fn method_not_allowed(allow: &[&str]) -> ApiError {
        ApiError {
            status: 405,
            message: format!("method not allowed; allowed: {}", allow.join(", ")),
            allow: Some(allow.join(", ")),
        }
    }

    pub fn body(&self) -> String {
        serde_json::json!({"code": self.status, "message": self.message}).to_string()
    }
}

impl From<OrchError> for ApiError {
    fn from(e: OrchError) -> ApiError {
        ApiError::new(e.status(), e.message())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orchestrator_errors_map_to_statuses() {
        let cases = [
            (OrchError::NotFound("x".into()), 404),
            (OrchError::BadRequest("x".into()), 400),
            (OrchError::Conflict("x".into()), 409),
            (OrchError::TooMany("x".into()), 429),
            (OrchError::Upstream("x".into()), 502),
            (OrchError::Unavailable("x".into()), 503),
            (OrchError::Internal("x".into()), 500),
            (OrchError::InsufficientStorage("x".into()), 507),
        ];
        for (e, status) in cases {
            let api = ApiError::from(e);
            assert_eq!(api.status, status);
            let body: serde_json::Value = serde_json::from_str(&api.body()).unwrap();
            assert_eq!(body["code"], status);
            assert_eq!(body["message"], "x");
        }
    }

    #[test]
    fn method_not_allowed_names_allowed_methods() {
        let e = ApiError::method_not_allowed(&["GET", "DELETE"]);
        assert_eq!(e.status, 405);
        assert_eq!(e.allow.as_deref(), Some("GET, DELETE"));
    }
}
