pub mod bench;
pub mod generate;
pub mod random_model;
