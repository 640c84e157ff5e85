# frozen_string_literal: true

# The schema db/migrate/ builds; bin/rails db:prepare loads it into a new
# database (and runs the migrations on one that has others).
ActiveRecord::Schema[7.2].define(version: 2026_11_23_000000) do
  create_table "notes", force: :cascade do |t|
    t.string "title", null: false
    t.text "body"
    t.datetime "created_at", null: false
    t.datetime "updated_at", null: false
  end
end
