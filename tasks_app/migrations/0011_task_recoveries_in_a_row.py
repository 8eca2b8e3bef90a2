from django.db import migrations, models
from django.db.models import F


def count_in_a_row(apps, schema_editor):
    # Tasks that were recovered before the rule: their count so far is taken as in a row, and
    # their high-water mark now as the last recovery's, so a step beyond it resets the count.
    Task = apps.get_model("tasks_app", "Task")
    Task.objects.filter(recoveries__gt=0).update(recoveries_in_a_row=F("recoveries"), recovered_at_step=F("steps_done"))


class Migration(migrations.Migration):

    dependencies = [
        ('tasks_app', '0010_tenant_daily_usage'),
    ]

    operations = [
        migrations.AddField(
            model_name='task',
            name='recoveries_in_a_row',
            field=models.IntegerField(default=0, db_default=0),
        ),
        migrations.AddField(
            model_name='task',
            name='recovered_at_step',
            field=models.IntegerField(default=0, db_default=0),
        ),
        migrations.RunPython(count_in_a_row, migrations.RunPython.noop),
    ]
