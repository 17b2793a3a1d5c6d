pub mod bench;
pub mod certs;
pub mod dev_certs;
pub mod generate;
pub mod nodes;
pub mod random_model;
pub mod serve;
pub mod up;
