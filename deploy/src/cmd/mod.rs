pub mod bench;
pub mod generate;
pub mod nodes;
pub mod random_model;
pub mod serve;
pub mod up;
